"""Fault injection: the stack under network faults, crashes and lost replies, checked against the
invariants of DESIGN.md section 3.

* ``proxy.py``: a TCP fault proxy (pass, blackhole, reset, delay, drop_reply_after) run in the test process.
* ``harness.py``: a Redis server of a scenario's own, a stack whose orchestrator reaches it through the
  proxy, a seeded workload.
* ``invariants.py``: the checks every scenario ends with (liveness polled, safety checked once).

Scenarios draw their random choices from ``fault_seed`` (``SAGA_FAULT_SEED`` reproduces one); long ones
are marked ``slow`` (``-m 'not slow'`` leaves them out).
"""
