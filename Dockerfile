# gateway-tasks: one image for every component (api, workers, beat, flower);
# the Kubernetes manifests in deploy/k8s pick the command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway_tasks ./gateway_tasks
COPY lua ./lua
COPY workers ./workers
COPY beat ./beat
RUN pip install . \
    && rm -rf /src \
    && useradd --create-home --uid 10001 --user-group gateway

WORKDIR /home/gateway
# numeric, so Kubernetes' runAsNonRoot can verify it
USER 10001
EXPOSE 8000 5555
CMD ["gateway", "api", "--host", "0.0.0.0", "--port", "8000"]
