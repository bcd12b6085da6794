"""Fault injection: the stack under network faults, crashes and lost replies, checked against the
invariants of DESIGN.md section 3.

* ``proxy.py``: a TCP fault proxy (pass, blackhole, reset, delay, drop_reply_after) run in the test process.
* ``harness.py``: a Redis server of a scenario's own, a stack whose orchestrator reaches it through the
  proxy, a seeded workload.
* ``invariants.py``: the checks every scenario ends with (liveness polled, safety checked once).
* ``lifecycle.py``: what a scenario does to processes and the broker, and how it proves it happened
  (a queue's active consumer, a crash at a named point, a broker restart).

Scenarios: a Redis cut and lost replies (``test_redis_cut``), a crash at each named crash point
(``test_crash_points``), a frozen active orchestrator and its standby (``test_standby_takeover``), the
broker and Redis restarted (``test_broker_and_redis_restarts``), a storm of duplicated, reordered, stale
and late reports (``test_storm``).

Scenarios draw their random choices from ``fault_seed`` (``SAGA_FAULT_SEED`` reproduces one); long ones
are marked ``slow`` (``-m 'not slow'`` leaves them out).
"""
