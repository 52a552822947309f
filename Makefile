# ElastiCo — every command a user or CI needs. `make demo` and `make test` work on a clean clone:
# they create .venv, install the pinned dependencies and generate the gRPC stubs first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
GEN    := elastico/v1/.generated
PROTOS := $(wildcard protos/elastico/v1/*.proto)
NODES  ?= 2
# pytest-xdist workers of `make test` (0 = serial, in the pytest process itself)
TEST_WORKERS ?= 2
# The interference model artifact: trained from the shipped data when absent or older than the code or
# data it is built from (seconds, fixed seed).
MODEL  := models/interference.json
MODEL_SRC := services/predictor/features.py services/predictor/datasets.py $(wildcard services/predictor/model/*.py) services/predictor/train.py $(wildcard data/*.csv) $(wildcard data/h200/*.csv)

.PHONY: all venv protos model test demo up down ps logs status bench device-deps clean distclean

all: protos

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 11) else f"ElastiCo needs Python 3.11 or newer; $(PYTHON) is {v.major}.{v.minor}: run make <target> PYTHON=python3.11 (or newer)")'
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || rm -rf $(VENV)  # a venv of an older Python
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

# Stubs (with .pyi) are generated into the git-ignored package elastico/v1, never committed.
$(GEN): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	@touch elastico/v1/__init__.py $@

protos: $(GEN)

$(MODEL): $(MODEL_SRC) | $(GEN)
	$(PY) -m services.predictor.train --out $(MODEL)

model: $(MODEL)

# The pure cores the type checker covers.
TYPED := elastico/coloc elastico/state services/pricer/core services/allocator/policy services/predictor/model \
         services/predictor/features.py services/predictor/datasets.py services/node_agent/pods.py

test: protos model
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check --quiet .
	$(BIN)/mypy $(TYPED)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

up: protos model
	$(PY) -m devtools.cluster up --nodes $(NODES)

down:
	@test -x $(PY) && $(PY) -m devtools.cluster down || true

ps: protos
	$(PY) -m devtools.cluster ps

logs: protos
	$(PY) -m devtools.cluster logs

status: protos
	$(PY) -m devtools.cluster status

# The README's first command: start the local cluster, show health and the GPUs the agents report, stop.
demo: protos model
	$(PY) -m devtools.demo --nodes $(NODES)

# Every benchmark that runs on this machine, one after another (bench.device_check needs a GPU: see below).
BENCHES := headline pricer predictor allocator state_reads reliability
bench: protos model
	@for m in $(BENCHES); do echo "== bench.$$m =="; $(PY) -m bench.$$m || exit 1; done

# bench.device_check on the GPU machine (no virtualenv there): the pinned structlog, unpacked into .device-deps/site;
# carry .device-deps and run `PYTHONPATH=.device-deps/site python3 -m bench.device_check --out DIR` from the root.
device-deps: $(STAMP)
	rm -rf .device-deps
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: \
	  structlog==$$(sed -n 's/^ *"structlog==\([^"]*\)".*/\1/p' pyproject.toml) -d .device-deps
	$(PY) -m zipfile -e .device-deps/structlog-*.whl .device-deps/site

clean:
	rm -rf .run .pytest_cache .hypothesis .mypy_cache .ruff_cache elastico/v1 models .device-deps
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: down clean
	rm -rf $(VENV) *.egg-info
