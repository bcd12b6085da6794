"""Versions pinned beside every compiled plan (and later every run).

They are recorded next to the plan but never hashed into its digest: a new release of the compiler must not
change the digest of a definition whose meaning did not change.
"""

DSL_VERSION = "1"
COMPILER_VERSION = "0.1.0"
ENGINE_VERSION = "0"  # no engine runs plans yet; the runtime issue sets this to "1"
PLAN_FORMAT = 1
