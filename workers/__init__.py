"""Worker SDK (``workers.sdk``) and the demo workers (``workers.demo``)."""
