"""The web console's own parts: the plan graph (``graph.plan_svg``), its page templates and static files
(``templates/``, ``static/``: plain HTML, CSS and JavaScript, no third-party bundle, shipped as package
data). Its routes are in ``orchestrator.server.console``."""
