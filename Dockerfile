# gateway-tasks: one image for every component (api, workers, beat, flower);
# the Kubernetes manifests in deploy/k8s pick the command.
#
# The base image is pinned by the digest of python:3.11-slim's multi-platform
# index (Python 3.11.15 on Debian trixie): a rebuild gets the same base, not
# whatever the tag points at that day.  Take base-image fixes by moving the pin:
#   docker buildx imagetools inspect python:3.11-slim   # "Digest: sha256:..."
FROM python:3.11-slim@sha256:90744cff8f32887f075c47d747a173ff333e9e98801667af93c357fa9f5e28ff

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# the runtime only: the dev tools (devtools/, gateway-tasks-devtools) stay out of the image
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
