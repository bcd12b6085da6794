"""How old a message may be when a shard takes it, by kind: no replay outlives what deduplicates it.

A signature says who sent a message, not when; a captured genuine message can be sent again. What refuses
the second copy is a record: a start's run (and its run-id claim), the run's set of applied message ids for
results, releases, refills, cancels and re-drives. Those records go with the run, ``retention_ms`` after
it ends, so a start replayed later would create its run again. Every message therefore carries the time it
was issued (``issued_at_ms``, under its signature), and a shard refuses, before any write, one older than
its kind's window or issued further in the future than the clock skew allows:

* ``message_window_ms``: every kind a run's records deduplicate. It must end before those records can
  expire (``Freshness.check_against``): then no copy is both outside every record and inside its window.
  It is also how long a message may legitimately wait in a shard queue (orchestrators down, Redis down);
  one that waited longer is refused and parked, and its run's own clocks take over.
* ``liveness_window_ms``: acceptances and heartbeats, which the applied set does not remember (an attempt
  beats often). The attempt's record refuses their copies instead: an acceptance acts once (the attempt
  is then running), and a heartbeat counts only if sent after the latest one applied
  (``engine/liveness.py``). A stale one is dropped, not parked: after a long outage there are many, and
  replaying them helps nobody.

Messages a process sends again on purpose are issued again: the relay re-signs what it re-publishes, and a
dead letter replayed by an operator is re-signed by the replaying process (``deadletters.py``). A broker
redelivery after a crash keeps its original time, so it is taken within the window like any other.
Pure: the caller gives the time.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.wire.kinds import Kind

#: Kinds the run's own records deduplicate, as they come into a shard queue.
RECORDED_KINDS = frozenset(
    {Kind.START, Kind.RESULT, Kind.RELEASE, Kind.REFILL, Kind.CANCEL_RUN, Kind.REDRIVE}
)
LIVENESS_KINDS = frozenset({Kind.ACCEPTED, Kind.HEARTBEAT})

STALE = "stale"
FUTURE = "future-dated"
DEFAULT_MESSAGE_WINDOW_MS = 86_400_000


@dataclass(frozen=True)
class Freshness:
    message_window_ms: int = DEFAULT_MESSAGE_WINDOW_MS
    liveness_window_ms: int = 300_000
    clock_skew_ms: int = 30_000

    @classmethod
    def for_retention(
        cls, retention_ms: int, message_window_ms: int | None, liveness_window_ms: int, clock_skew_ms: int
    ) -> Freshness:
        """The windows of runs kept ``retention_ms``: an unset message window is a day, or half the
        retention if that is shorter."""
        window = message_window_ms
        if window is None:
            window = min(DEFAULT_MESSAGE_WINDOW_MS, retention_ms // 2)
        return cls(window, liveness_window_ms, clock_skew_ms)

    def window_ms(self, kind: Kind) -> int | None:
        """How old a message of ``kind`` may be when a shard takes it; None: shards take no such kind."""
        if kind in RECORDED_KINDS:
            return self.message_window_ms
        if kind in LIVENESS_KINDS:
            return self.liveness_window_ms
        return None

    def refusal(self, kind: Kind, message_id: str, issued_at_ms: int, now_ms: int) -> tuple[str, str] | None:
        """Why a shard refuses this message now (reason, detail), or None: it is fresh."""
        ahead, age = issued_at_ms - now_ms, now_ms - issued_at_ms
        if ahead > self.clock_skew_ms:
            return FUTURE, (
                f"message {message_id} was issued at {issued_at_ms}, {ahead} ms ahead of this orchestrator's "
                f"clock, beyond the {self.clock_skew_ms} ms skew allowed (SAGA_CLOCK_SKEW_MS): check the "
                "sender's clock"
            )
        window = self.window_ms(kind)
        if window is None or age <= window:
            return None
        return STALE, (
            f"{kind.value} message {message_id} was issued at {issued_at_ms}, {age} ms ago, beyond its "
            f"{window} ms window: a copy of a message that may already have acted; if it is genuine and "
            "still wanted, replay it (saga dead-letters replay issues it again)"
        )

    def check_against(self, retention_ms: int) -> str | None:
        """What is wrong with these windows for runs kept ``retention_ms`` after they end, or None."""
        longest = self.message_window_ms + self.clock_skew_ms
        if longest >= retention_ms:
            return (
                f"the message window ({self.message_window_ms} ms, SAGA_MESSAGE_WINDOW_MS; unset: the "
                f"smaller of a day and half the retention) plus SAGA_CLOCK_SKEW_MS ({self.clock_skew_ms}) "
                f"must be shorter than SAGA_RETENTION_MS ({retention_ms}): a start replayed after its "
                "run's records expired would start the run again. Shorten the window or the skew, or keep "
                "runs for longer"
            )
        return None
