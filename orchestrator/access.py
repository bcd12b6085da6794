"""Least privilege: the Redis ACL rules and RabbitMQ permissions of each role (pure).

Every role gets a Redis user limited to the namespace's keys (``<prefix>:*``) and channels, never
FLUSHALL, CONFIG, KEYS, DEBUG or any other ``@dangerous`` command, and a RabbitMQ user limited to the
exchanges and queues it uses (RabbitMQ's configure, write and read regular expressions; a passive declare
needs none):

* ``orchestrator``: runs the transitions (FCALL) on every key of the namespace, loads its function
  library, reads INFO (whether Redis persists); consumes shard queues, declares contract queues, publishes
  tasks, continuations, events and refusals.
* ``worker``: its presence in the worker registry, the serial lane, and the demo apps' keys; declares and
  consumes contract queues (and a private queue of cancellations), publishes results and refusals.
  Never a start exchange, never a shard queue.
* ``client``: reads runs and plans, claims idempotency keys; publishes starts, cancels and re-drives.
* ``server``: the control plane: a client that also keeps tokens, definitions and the shard map, and
  handles dead letters.
* ``admin``: everything on the namespace (``saga topology apply``, governance, tokens, purges), still
  without dangerous commands.

:func:`redis_acl` gives ``ACL SETUSER`` arguments, :func:`rabbitmq_permissions` the three expressions,
:func:`rabbitmq_password_hash` what RabbitMQ's definitions carry for a password.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from dataclasses import dataclass
from enum import StrEnum


class AccessRole(StrEnum):
    ORCHESTRATOR = "orchestrator"
    WORKER = "worker"
    CLIENT = "client"
    SERVER = "server"
    ADMIN = "admin"


# Commands every role needs to talk at all (AUTH, HELLO, PING, SELECT, CLIENT SETNAME ...).
_BASE = ["-@all", "+@connection", "-@dangerous"]
# Reads, writes, Lua and MULTI on the keys it may touch; INFO (persistence, for the start-up check) and
# the cluster client's topology commands, which @dangerous would otherwise take away.
_WORKING = ["+@read", "+@write", "+@scripting", "+@transaction", "+@pubsub", "-@dangerous", "+info", "+time"]
_CLUSTER = ["+cluster|slots", "+cluster|shards", "+cluster|nodes", "+cluster|myid", "+readonly", "+readwrite"]
_NO_FUNCTION_CHANGES = ["-function|flush", "-function|delete", "-function|restore"]


def user_name(prefix: str, role: AccessRole) -> str:
    """The user a role connects as, in Redis and in RabbitMQ: ``saga-orchestrator``."""
    return f"{prefix}-{role.value}"


def _keys(prefix: str, role: AccessRole) -> list[str]:
    everything = [f"~{prefix}:*", f"&{prefix}:*"]
    if role is AccessRole.WORKER:
        # its presence, the serial lane's lease and the demo apps' effects (an app of yours keeps its own
        # keys under a user of its own); no channel
        return [f"~{prefix}:{{workers}}:*", f"~{prefix}:{{serial}}:*", f"~{prefix}:demo:*"]
    if role is AccessRole.CLIENT:
        # reads every run and plan; writes only its idempotency claims; hears runs end
        return [f"%R~{prefix}:*", f"%RW~{prefix}:idempotency:*", f"&{prefix}:finished:*"]
    return everything


def redis_acl(prefix: str, role: AccessRole, password: str) -> list[str]:
    """The ``ACL SETUSER <user>`` rules of ``role`` (after the user name): a whole definition, replacing
    whatever the user had (``reset``)."""
    rules = ["reset", "on", f">{password}", *_keys(prefix, role), *_BASE]
    if role is AccessRole.CLIENT:
        # reads; claims (SET NX) and gives back (DEL, in a script) its idempotency keys; TIME (membership)
        rules += ["+@read", "+set", "+del", "+eval", "+evalsha", "+subscribe", "+unsubscribe", "-@dangerous"]
        rules += ["+time"]
    else:
        rules += _WORKING
        if role in (AccessRole.WORKER, AccessRole.SERVER):
            rules += ["-fcall", "-fcall_ro", "-function"]  # the transitions are the orchestrator's alone
        if role is AccessRole.WORKER:
            rules += ["-scan", "-randomkey", "-pubsub"]  # not even the names of keys it may not read
        elif role is AccessRole.ORCHESTRATOR:
            rules += _NO_FUNCTION_CHANGES
    return [*rules, *_CLUSTER]


@dataclass(frozen=True)
class Permissions:
    """RabbitMQ's configure, write and read expressions of a role in a vhost."""

    configure: str
    write: str
    read: str


def _any_of(*patterns: str) -> str:
    return "^(" + "|".join(patterns) + ")$" if patterns else "^$"


def rabbitmq_permissions(namespace: str, role: AccessRole) -> Permissions:
    """What ``role`` may do in the vhost of namespace ``namespace``."""
    ns = re.escape(namespace)
    task_queues = rf"{ns}\.task\..*"  # contract queues and their dead-letter queues
    # a private queue (a worker's cancellations): named by the broker (amq.gen-...) or by the client
    # library (aio-pika's amq_<hex>)
    private = r"amq\.gen-.*|amq_[0-9a-f]+"
    if role is AccessRole.ORCHESTRATOR:
        return Permissions(
            configure=_any_of(task_queues),
            write=_any_of(task_queues, rf"{ns}\.(tasks|runs|events|dlx)", r"amq\.default"),
            read=_any_of(rf"{ns}\.shard\..*", task_queues, rf"{ns}\.(tasks|dlx)"),
        )
    if role is AccessRole.WORKER:
        return Permissions(
            configure=_any_of(task_queues, private),
            # tasks: a container it cannot take whole goes back to it split, or a task it spills
            write=_any_of(task_queues, private, rf"{ns}\.(runs|tasks|dlx)", r"amq\.default"),
            read=_any_of(task_queues, private, rf"{ns}\.(tasks|dlx|events)"),
        )
    if role is AccessRole.CLIENT:
        return Permissions(configure="^$", write=_any_of(rf"{ns}\.start\..*", rf"{ns}\.runs"), read="^$")
    if role is AccessRole.SERVER:
        dead_letters = rf"{ns}\..*\.dlq|{ns}\.rejected"
        return Permissions(
            configure="^$",
            write=_any_of(rf"{ns}\.start\..*", rf"{ns}\.runs", r"amq\.default"),
            read=_any_of(dead_letters),
        )
    everything = rf"{ns}\..*"  # the namespace's, not another's on a shared vhost
    return Permissions(
        configure=_any_of(everything), write=_any_of(everything, r"amq\.default"), read=_any_of(everything)
    )


def rabbitmq_password_hash(password: str, salt: bytes | None = None) -> str:
    """The ``password_hash`` RabbitMQ's definitions carry (``rabbit_password_hashing_sha256``): base64 of
    a 4-byte salt and SHA-256 of the salt and the password."""
    salt = os.urandom(4) if salt is None else salt
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def rabbitmq_definitions(
    namespace: str, vhost: str, passwords: dict[AccessRole, str], prefix: str
) -> dict[str, object]:
    """RabbitMQ definitions (``rabbitmqctl import_definitions``, or ``load_definitions`` at boot) of each
    role's user and permissions in ``vhost``."""
    users = []
    permissions = []
    for role, password in passwords.items():
        name = user_name(prefix, role)
        users.append(
            {
                "name": name,
                "password_hash": rabbitmq_password_hash(password),
                "hashing_algorithm": "rabbit_password_hashing_sha256",
                "tags": [],  # none: the management UI's administrators are the broker's, not saga's
            }
        )
        allowed = rabbitmq_permissions(namespace, role)
        permissions.append(
            {
                "user": name,
                "vhost": vhost,
                "configure": allowed.configure,
                "write": allowed.write,
                "read": allowed.read,
            }
        )
    return {"users": users, "vhosts": [{"name": vhost}], "permissions": permissions}


def acl_file(prefix: str, passwords: dict[AccessRole, str]) -> str:
    """A Redis ACL file (``redis-server --aclfile``) of each role's user, the default user switched off."""
    lines = ["user default off"]  # (an ACL file takes no comments)
    for role, password in passwords.items():
        rules = [r for r in redis_acl(prefix, role, password) if r != "reset"]
        lines.append(f"user {user_name(prefix, role)} {' '.join(rules)}")
    return "\n".join(lines) + "\n"
