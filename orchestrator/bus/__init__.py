"""RabbitMQ: names, topology, envelopes, publishing. Importing it installs coalesced frame writes."""

from orchestrator.bus.coalesce import install

install()
