"""The wire protocol: what travels between clients, shards and workers, in one pure package.

``kinds`` names the messages, ``ids`` derives their deterministic ids, fences and labels (and parses
them strictly), ``sizes`` bounds them, and ``bodies`` gives each kind's body an encoder for its senders
and, where the receiver must not trust it, a typed decoder. The signed envelope around a body is
``orchestrator.bus.envelope``. No I/O and no clock here.
"""
