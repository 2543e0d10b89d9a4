# molctl: `make demo` and `make test` work from a clean clone; work already done is skipped.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: venv dev test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Editable install with the development tools; redone only when pyproject.toml changes.
$(VENV)/.stamp-dev: pyproject.toml | $(PY)
	$(PIP) install -e '.[dev]'
	touch $@

dev: $(VENV)/.stamp-dev

test: $(VENV)/.stamp-dev
	$(PY) -m pytest -q

bench: $(VENV)/.stamp-dev
	$(PY) bench/bench_cli.py
	$(PY) bench/bench_proxy.py
	$(PY) bench/bench_lifecycle.py

clean:
	rm -rf $(VENV) build *.egg-info
