"""Versions pinned beside every compiled plan and, at creation, in every run (DESIGN.md invariant 8).

They are recorded next to the plan but never hashed into its digest: a new release of the compiler must not
change the digest of a definition whose meaning did not change. A run's record keeps the versions stored
beside the plan it pins (``plan_versions``) and the version of the engine that created it
(``engine_version``); ``saga status --json`` shows both.

* ``DSL_VERSION``: the definition language a plan was written in; raised when a definition that was valid
  means something else, or stops being valid.
* ``COMPILER_VERSION``: the release of the compiler that made the plan: the package version
  (``pyproject.toml``; a unit test keeps the two equal). Read from here, not from the installed package's
  metadata: the compiler is pure, and reads no files.
* ``ENGINE_VERSION``: the semantics of the engine that runs plans (routing, retries, finalisers,
  compensations, result checks); raised when the same events would lead a run to different decisions.
"""

DSL_VERSION = "1"
COMPILER_VERSION = "0.1.0"
ENGINE_VERSION = "1"
PLAN_FORMAT = 1
