"""The durability decision (``orchestrator.durability.assess``) over facts, without Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.durability import (
    Facts,
    Role,
    Verdict,
    assess,
    default_redis_user,
    development_key_ids,
    gather,
    redis_location,
)
from orchestrator.settings import DEVELOPMENT_SIGNING_KEY, Settings

DURABLE = {"aof_enabled": True, "appendfsync": "always"}
WHERE = "10.0.0.5:6380/2"


def facts(mode: str = "production", role: Role = Role.ORCHESTRATOR, **found: Any) -> Facts:
    return Facts(mode=mode, role=role, redis=WHERE, **found)


def test_production_starts_quietly_on_a_durable_redis_and_own_keys() -> None:
    assert assess(facts(**DURABLE)) == Verdict((), ())
    assert assess(facts(role=Role.WORKER)) == Verdict((), ())


def test_production_refuses_a_redis_that_persists_nothing() -> None:
    [refusal] = assess(facts(aof_enabled=False)).refusals
    assert WHERE in refusal and "aof_enabled:0" in refusal and "--appendonly yes" in refusal


def test_production_refuses_a_redis_it_cannot_check() -> None:
    [refusal] = assess(facts(redis_error="ConnectionError: refused")).refusals
    assert "ConnectionError: refused" in refusal and "SAGA_REDIS_URL" in refusal


def test_a_worker_owns_no_state_so_redis_does_not_matter_to_it() -> None:
    assert assess(facts(role=Role.WORKER, aof_enabled=False)) == Verdict((), ())


@pytest.mark.parametrize("role", list(Role))
def test_production_refuses_the_development_signing_key_for_every_role(role: Role) -> None:
    verdict = assess(facts(role=role, development_keys=("dev", "old"), **DURABLE))
    [refusal] = verdict.refusals
    assert "'dev', 'old'" in refusal and "SAGA_SIGNING_KEYS" in refusal


def test_production_collects_every_refusal_at_once() -> None:
    assert len(assess(facts(aof_enabled=False, development_keys=("dev",))).refusals) == 2


@pytest.mark.parametrize(("fsync", "says"), [("everysec", "~1 s"), ("no", "not yet flushed")])
def test_production_warns_but_starts_when_fsync_is_not_always(fsync: str, says: str) -> None:
    verdict = assess(facts(aof_enabled=True, appendfsync=fsync))
    assert verdict.refusals == ()
    [warning] = verdict.warnings
    assert f"appendfsync {fsync}" in warning and says in warning and "stall until reconciled" in warning


def test_production_says_nothing_when_fsync_cannot_be_read() -> None:
    # CONFIG GET is often disabled on managed Redis: the AOF being on is all that can be known.
    assert assess(facts(aof_enabled=True, appendfsync=None)) == Verdict((), ())


def test_development_never_refuses_and_warns_once_naming_every_loss() -> None:
    verdict = assess(facts("development", aof_enabled=False, development_keys=("dev",)))
    assert verdict.refusals == ()
    [warning] = verdict.warnings
    assert "every run on a Redis restart" in warning and "saga.rejected" in warning
    assert "forge" in warning and "SAGA_MODE=production" in warning


def test_development_warns_even_when_nothing_can_be_lost() -> None:
    [warning] = assess(facts("development", **DURABLE)).warnings
    assert "not enforced" in warning


def test_a_development_worker_only_hears_about_its_keys() -> None:
    [warning] = assess(facts("development", Role.WORKER, development_keys=("dev",))).warnings
    assert "forge" in warning and "Redis" not in warning


def test_the_development_key_is_found_under_any_id_and_only_by_its_secret() -> None:
    secret = DEVELOPMENT_SIGNING_KEY.partition(":")[2]
    assert development_key_ids((f"new:{'x' * 32}", DEVELOPMENT_SIGNING_KEY, f"alias:{secret}")) == (
        "dev",
        "alias",
    )
    assert development_key_ids(("dev:something-else",)) == ()
    assert development_key_ids(Settings().signing_keys) == ("dev",)


def test_a_redis_location_never_shows_the_password() -> None:
    assert redis_location("redis://:hunter2@cache.internal:6380/3") == "cache.internal:6380/3"
    assert redis_location("redis://localhost") == "localhost:6379/0"


@pytest.mark.parametrize("role", list(Role))
def test_production_refuses_the_all_powerful_default_users_and_unscoped_keys(role: Role) -> None:
    refusals = assess(
        facts(role=role, **DURABLE, default_redis_user=True, amqp_guest=True, unscoped_keys=True)
    )
    redis_user, guest, unscoped = refusals.refusals
    assert "as the default user" in redis_user and f"secrets/{role.value}.env" in redis_user
    assert "as guest" in guest and "saga provision" in guest
    assert "SAGA_KEY_RING_FILE" in unscoped and "unscoped" in unscoped
    assert not assess(facts(mode="development", role=role, default_redis_user=True, amqp_guest=True)).refusals


@pytest.mark.parametrize(
    ("url", "default"),
    [
        ("redis://127.0.0.1:6379/0", True),
        ("redis://:secret@127.0.0.1:6379/0", True),
        ("redis://default:secret@127.0.0.1:6379/0", True),
        ("redis://saga-orchestrator:secret@127.0.0.1:6379/0", False),
        ("redis+cluster://saga-worker:s@10.0.0.1:7000,10.0.0.2:7000", False),
        ("redis+cluster://10.0.0.1:7000", True),
    ],
)
def test_the_default_redis_user_is_the_one_a_url_names_or_none(url: str, default: bool) -> None:
    assert default_redis_user(url) is default


def test_gathered_facts_name_guest_and_unscoped_keys_without_asking_anything(tmp_path: Path) -> None:
    found = gather(
        Settings(amqp_url="amqp://127.0.0.1:5672/", redis_url="redis://u:p@127.0.0.1:1/0"), Role.WORKER
    )
    assert found.amqp_guest and found.unscoped_keys and not found.default_redis_user
    ring = tmp_path / "ring.yaml"
    ring.write_text("keys: []\n")
    mine = gather(
        Settings(amqp_url="amqp://saga-worker:x@127.0.0.1:5672/v", key_ring_file=str(ring)), Role.WORKER
    )
    assert not mine.amqp_guest and not mine.unscoped_keys and mine.default_redis_user
