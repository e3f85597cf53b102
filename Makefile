# `make run`  : set up .venv and run simulator + admission service + Envoy in the foreground.
# `make test` : set up .venv, lint (ruff; mypy, strict on extproc) and run the whole test suite.
# ENGINE_URL=http://host:8000 make run   fronts a real vLLM instead of the simulator.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup system-deps vllm-env run test unit lint generate docs image image-smoke clean help

help:
	@echo "make run           run simulator (or ENGINE_URL) + extproc + Envoy on :8080 (Ctrl-C stops all)"
	@echo "                   ENGINE=vllm make run: a real vLLM (CPU build, tiny local model) instead of the simulator"
	@echo "make test          lint, then run the whole test suite (installs vLLM's CPU build for its real-engine tests)"
	@echo "make unit          run only the fast unit tests"
	@echo "make lint          ruff and mypy (mypy strict on the service package); make test runs it first"
	@echo "make generate      rewrite every generated file: envoy/envoy.yaml, the dashboard and the chart's"
	@echo "                   copies, the ext_proc stubs in extproc/_proto, the docs' settings page"
	@echo "                   (a test fails when one is stale)"
	@echo "make docs          build the docs site into site/ (mkdocs --strict: a broken link fails; make test checks it too)"
	@echo "make image         build the service's image with docker, podman or buildah (IMAGE_BUILDER picks;"
	@echo "                   PYTHON_IMAGE=<local base> IMAGE_PULL=never builds without a registry)"
	@echo "make image-smoke   check-config and check against the simulator inside the image (skips without a builder)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

setup: $(STAMP)

run: $(STAMP) $(if $(filter vllm,$(ENGINE)),vllm-env)
	$(PY) -m devstack

# vLLM's CPU build in an environment of its own (.venv-vllm): ~3 min and ~3.5 GB the first time.
vllm-env:
	bash scripts/install-vllm.sh

system-deps:
	bash scripts/install-system-deps.sh

test: $(STAMP) system-deps vllm-env lint
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest tests/unit tests/enginesim -q

generate: $(STAMP)
	$(PY) scripts/generate.py

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

image:
	bash scripts/image.sh build

image-smoke: $(STAMP)
	bash scripts/image-smoke.sh

clean:
	rm -rf $(VENV) .venv-vllm .cache run site .pytest_cache .hypothesis *.egg-info
