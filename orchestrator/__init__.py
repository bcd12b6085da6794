"""saga-orchestrator: governed, versioned multi-stage workflows on RabbitMQ and Redis."""

from orchestrator.versions import COMPILER_VERSION, DSL_VERSION, ENGINE_VERSION

__all__ = ["COMPILER_VERSION", "DSL_VERSION", "ENGINE_VERSION"]
