"""The new worker after the upgrade: serves ``probe.render@4`` only (no adapter for ``@3``)."""

from __future__ import annotations

from tests.integration.probe_apps.render_v4 import render_v4

__all__ = ["render_v4"]
