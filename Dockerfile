# One image for every ElastiCo service; the service is chosen by the command, e.g.
#   docker run elastico python -m services.allocator
# Runs as the unprivileged user elastico (uid 10001). Only the node agent overrides it with root (the DaemonSet's
# runAsUser 0, compose's user: root): MPS needs one UID per node, and a root agent starts workloads as the
# unprivileged workload user, who cannot read the agent's key.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ELASTICO_HOST=0.0.0.0 ELASTICO_LOG_FORMAT=json
WORKDIR /app

RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*

# Dependencies first, for layer caching.
COPY pyproject.toml README.md ./
RUN mkdir -p elastico services simulator bench && touch elastico/__init__.py services/__init__.py \
      simulator/__init__.py bench/__init__.py \
    && pip install --no-cache-dir -e . && rm -rf elastico services simulator bench

# The sources by name, not `COPY . .`: a checkout's .venv and the local cluster's run directory (.run: its CA key,
# certificates and tokens) must never end up in an image layer.
COPY Makefile ./
COPY protos/ protos/
COPY data/ data/
COPY scripts/ scripts/
COPY elastico/ elastico/
COPY services/ services/
COPY simulator/ simulator/
COPY bench/ bench/
# Stubs are generated here (never copied from the checkout) and the interference model trained from the shipped
# data (seconds, fixed seed), so the image does not depend on the builder's git-ignored files.
RUN rm -rf elastico/v1 models && find . -name __pycache__ -prune -exec rm -rf {} + \
    && python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/elastico/v1/*.proto \
    && touch elastico/v1/__init__.py \
    && python -m services.predictor.train --out models/interference.json \
    && useradd --uid 10001 --create-home elastico
# The code and the shipped model stay root-owned (read-only to the services); the predictor writes its retrained
# models to its state dir, ~elastico/.local/state/elastico/predictor (ELASTICO_STATE_DIR overrides it).
USER 10001

CMD ["python", "-m", "services.allocator"]
