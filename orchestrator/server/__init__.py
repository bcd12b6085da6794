"""``saga server``: the control plane's HTTP API (``/api/v1``) over the same stores and messages the CLI
uses, with bearer tokens, roles and the identity of every change in its audit record."""
