"""``python -m orchestrator`` is the ``saga`` command."""

from orchestrator.cli import main

main()
