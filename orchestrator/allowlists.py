"""Reading the allowlist file named by ``SAGA_ALLOWLIST_FILE``, at the edge: the compiler only parses
and checks (``orchestrator/compiler/allowlist.py``)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.compiler.allowlist import SETTING, Allowlist, AllowlistError, parse_allowlist


def load_allowlist(file: str | None) -> Allowlist | None:
    """Read and parse the allowlist ``file`` (None or "": no allowlist). Raises :class:`AllowlistError`."""
    if not file:
        return None
    try:
        text = Path(file).read_bytes()
    except OSError as exc:
        todo = f"point {SETTING} at a readable allowlist file, or unset it"
        raise AllowlistError(file, f"cannot be read: {exc.strerror or exc}", todo=todo) from exc
    return parse_allowlist(text, file)
