"""How a location inside a definition is written in error messages: ``stages[2].input.modelId``."""

from __future__ import annotations

Path = tuple[str | int, ...]


def render_path(path: Path) -> str:
    """Render a path the way a reader finds it in the file; the root is ``definition``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out:
            out += f".{part}"
        else:
            out = part
    return out or "definition"
