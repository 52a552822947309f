# One image for every ElastiCo service; the service is chosen by the command, e.g.
#   docker run elastico python -m services.allocator
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

COPY . .
RUN python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/elastico/v1/*.proto \
    && touch elastico/v1/__init__.py \
    && useradd --uid 10001 --create-home elastico && chown -R elastico /app
USER 10001

CMD ["python", "-m", "services.allocator"]
