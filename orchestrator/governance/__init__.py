"""Governing definitions: immutable versions, their lifecycle (publish, approve, activate, canary, promote,
abort, rollback, retire), the audit of every change, and which version a new run uses."""
