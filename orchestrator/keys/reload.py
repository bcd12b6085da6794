"""Running processes pick up a changed key ring without a restart.

A process started with ``SAGA_KEY_RING_FILE`` checks once a second whether the ring file or any secret
file it names changed (size, modification time, inode: a file replaced by ``saga keys`` or by a
configuration tool), and reloads at once on SIGHUP. A reload replaces the signer's ring in one step; a
ring that cannot be read is logged and the process keeps the one it has, so a bad edit never stops a
process verifying.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from orchestrator.bus.envelope import Signer
from orchestrator.keys.ring import KeyState, Ring
from orchestrator.keys.ringfile import KeyRingError, load_ring, read_ring_file, secret_path
from orchestrator.sealing import PREFIX, Sealer, SealError
from orchestrator.settings import Settings

log = logging.getLogger(__name__)

POLL_S = 1.0

Fingerprint = tuple[tuple[str, int, int, int] | tuple[str], ...]


@dataclass(frozen=True)
class RingSource:
    """Where a process's ring comes from."""

    path: Path
    retire_grace_ms: int
    environ: Mapping[str, str]

    def load(self) -> Ring:
        return load_ring(self.path, self.retire_grace_ms, self.environ)

    def fingerprint(self) -> Fingerprint:
        """What changes when the ring file or a secret file it names changes."""
        paths = [self.path]
        with contextlib.suppress(KeyRingError):
            contents = read_ring_file(self.path)
            paths += [p for e in contents.keys if (p := secret_path(self.path, e)) is not None]
        return tuple(_stat(p) for p in paths)


def _stat(path: Path) -> tuple[str, int, int, int] | tuple[str]:
    try:
        found = path.stat()
    except OSError:
        return (str(path),)
    return str(path), found.st_size, found.st_mtime_ns, found.st_ino


def source_of(settings: Settings) -> RingSource | None:
    if settings.key_ring_file is None:
        return None
    return RingSource(Path(settings.key_ring_file), settings.key_retire_grace_ms, os.environ)


def signer_for(settings: Settings) -> Signer:
    """The process's signer: the key ring file's keys if ``SAGA_KEY_RING_FILE`` is set, else the unscoped
    ``SAGA_SIGNING_KEYS``. Raises KeyRingError (what is wrong with the file) or SagaError."""
    source = source_of(settings)
    if source is None:
        return Signer.from_settings(settings.signing_keys)
    seen = source.fingerprint()  # before reading: a change from here on is reloaded
    ring = source.load()
    log.info("key ring %s: %s", source.path, describe(ring))
    signer = Signer(ring)
    _LOADED[signer] = seen
    return signer


# What each signer's ring was loaded from, so that a watcher started later reloads a change made between.
_LOADED: weakref.WeakKeyDictionary[Signer, Fingerprint] = weakref.WeakKeyDictionary()


def data_key(settings: Settings) -> bytes | None:
    """The key ring's ``data`` key, which marks sensitive values where they are shown (None without a
    ring, or where this process does not hold it)."""
    source = source_of(settings)
    return source.load().data_secret() if source is not None else None


def sealer_for(settings: Settings) -> Sealer | None:
    """What opens sensitive values sealed at rest, for a process that shows runs: the key ring's data keys
    (None without a ring)."""
    source = source_of(settings)
    if source is None:
        return None
    ring = source.load()
    return Sealer(lambda: ring)


def opened(record: dict[str, str], sealer: Sealer | None) -> dict[str, str]:
    """``record`` with the values sealed at rest opened where ``sealer`` can (else as it is: a view then
    shows them as sensitive)."""
    if sealer is None or not any(PREFIX in value for value in record.values()):
        return record
    try:
        return sealer.unseal_record(record, record.get("run_id", ""))
    except SealError:
        return record


def tenant_scope(signer: Signer, settings: Settings) -> str | None:
    """The tenant whose runs this process sees and acts on: that of the client key it starts runs with,
    unless that is the platform's own tenant (``SAGA_PLATFORM_TENANT``); None (every tenant's) for an
    operator's, the server's or an unscoped key."""
    tenant = signer.bound_tenant()
    return None if tenant == settings.platform_tenant else tenant


def describe(ring: Ring) -> str:
    held = [f"{k.key_id} ({k.scope.value}, {k.state.value})" for k in ring.held()]
    missing = [k.key_id for k in ring.keys if k.secret is None]
    text = f"holding {', '.join(held) or 'no key'}"
    return text + (f"; not holding {', '.join(missing)}" if missing else "")


def reload(signer: Signer, source: RingSource) -> bool:
    """Replace ``signer``'s ring with the file's; False (logged, the old ring kept) if it cannot be read.
    A key this process held that is still in the ring, not retired, but whose secret is gone or
    unreadable (mid-deploy) keeps the secret it had, with a warning: else every message it signed would
    be refused."""
    try:
        ring = source.load()
    except KeyRingError as exc:
        log.error("key ring not reloaded, the previous one stays in use: %s", exc)
        return False
    lost = lost_keys(signer.ring, ring)
    if lost:
        log.warning(
            "key ring %s: the secret of %s (still in the ring, not retired) can no longer be read here; "
            "this process keeps the one it held. Restore it, or retire the key before taking it away",
            source.path,
            ", ".join(lost),
        )
        ring = kept(ring, signer.ring, lost)
    signer.ring = ring
    log.info("key ring %s reloaded: %s", source.path, describe(ring))
    return True


def kept(ring: Ring, before: Ring, lost: list[str]) -> Ring:
    """``ring`` with the secrets ``before`` held of the ``lost`` keys."""
    held = {k.key_id: k.secret for k in before.keys if k.key_id in lost}
    keys = tuple(dataclasses.replace(k, secret=held[k.key_id]) if k.key_id in held else k for k in ring.keys)
    return Ring(keys, ring.retire_grace_ms)


def lost_keys(before: Ring, after: Ring) -> list[str]:
    """Keys ``before`` held that ``after`` still lists, not retired, but no longer holds."""
    return [
        key.key_id
        for key in before.held()
        if (now := after.get(key.key_id)) is not None
        and now.secret is None
        and now.state is not KeyState.RETIRED
    ]


async def keep_reloaded(
    signer: Signer, source: RingSource, poll_s: float = POLL_S, *, on_hangup: bool = True
) -> None:
    """Reload ``signer``'s ring whenever its files change or (``on_hangup``: saga's own processes, never
    a library's host) the process gets SIGHUP; runs until cancelled."""
    hangup = asyncio.Event()
    loop = asyncio.get_running_loop()
    handles_hangup = False
    if on_hangup:
        try:
            loop.add_signal_handler(signal.SIGHUP, hangup.set)
            handles_hangup = True
        except (RuntimeError, ValueError):  # not the main thread: files are still watched
            pass
    seen = _LOADED.get(signer) or source.fingerprint()
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hangup.wait(), poll_s)
            now = source.fingerprint()
            if hangup.is_set() or now != seen:
                hangup.clear()
                seen = now
                reload(signer, source)
    finally:
        if handles_hangup:
            loop.remove_signal_handler(signal.SIGHUP)


def start_reloading(
    signer: Signer, settings: Settings, *, on_hangup: bool = True
) -> Callable[[], Awaitable[None]]:
    """Keep ``signer`` reloaded from now on (nothing to do without a ring file); returns what stops it.
    ``on_hangup``: also on SIGHUP (saga's own processes; a client library leaves its host's signals be)."""
    source = source_of(settings)
    if source is None:
        return _nothing
    task = asyncio.create_task(keep_reloaded(signer, source, on_hangup=on_hangup), name="key-ring-reload")

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return stop


async def _nothing() -> None:
    return None


class RingFollower:
    """For a process without an event loop (the blocking client): :meth:`check` before signing reloads
    the ring if its files changed, looking at most once every ``poll_s``."""

    def __init__(self, signer: Signer, settings: Settings, poll_s: float = POLL_S) -> None:
        self.signer = signer
        self.source = source_of(settings)
        self.poll_s = poll_s
        self._seen = self.source.fingerprint() if self.source is not None else ()
        self._checked = time.monotonic()

    def check(self) -> None:
        if self.source is None or time.monotonic() - self._checked < self.poll_s:
            return
        self._checked = time.monotonic()
        now = self.source.fingerprint()
        if now != self._seen:
            self._seen = now
            reload(self.signer, self.source)
