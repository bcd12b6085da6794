"""The main job, for now: validate and compile every definition, then show the model-ingest plan.

Run it with `make demo`. Each step is a real `saga` command, echoed before it runs, so you can repeat
any of them by hand. (Running definitions end to end arrives with the runtime.)
"""

from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAGA = [sys.executable, "-m", "orchestrator"]


def run(*args: str) -> None:
    print(f"\n$ saga {' '.join(args)}", flush=True)
    done = subprocess.run([*SAGA, *args], cwd=ROOT, check=False)
    if done.returncode != 0:
        sys.exit(f"demo: 'saga {' '.join(args)}' failed with exit code {done.returncode}")


def main() -> None:
    definitions = sorted(glob.glob("definitions/*.yaml", root_dir=ROOT))
    run("contracts", "list")
    run("validate", *definitions)
    for path in definitions:
        run("compile", path)
    run("graph", "definitions/model-ingest.yaml")
    print(
        "\nWhat to try next:\n"
        "  paste the graph above into https://mermaid.live to see it drawn\n"
        "  .venv/bin/saga compile definitions/model-ingest.yaml --json   # the canonical plan and digest\n"
        "  edit a definition (misspell an on_success target) and run .venv/bin/saga validate on it\n"
    )


if __name__ == "__main__":
    main()
