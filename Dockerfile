# One image for every saga process: orchestrator shards, worker pools, and the CLI.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY orchestrator orchestrator
COPY workers workers
COPY definitions definitions
RUN pip install --no-cache-dir .
# Production-like defaults for the compose stack; override with SAGA_* variables.
ENV SAGA_AMQP_URL=amqp://saga:saga-dev-password@rabbitmq:5672/ \
    SAGA_REDIS_URL=redis://saga-admin:admin-dev-password@redis:6379/0 \
    PYTHONUNBUFFERED=1
ENTRYPOINT ["saga"]
