# strawq: two commands on a fresh machine.
#   make demo   the main job: an end-to-end RL run on embedded defaults
#   make test   the test suite (brings up a real two-client JuiceFS volume when /dev/fuse exists)
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch (a plain `torch` requirement would pull a multi-GB CUDA build).
TORCH_SPEC ?= torch==2.13.0
JFS_DIR ?= $(CURDIR)/.juicefs-test
PYTEST_ARGS ?=
# slime has no registry release: a source tarball of it (the project's pinned peer) enables
# the slime adapter's tests, e.g. make install SLIME_SRC=/path/to/slime-624b824.tar.gz
SLIME_SRC ?=

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[all,juicefs,megatron]"
	if [ -n "$(SLIME_SRC)" ]; then \
	  $(PY) -m pip install -q --no-deps "$(SLIME_SRC)" && \
	  $(PY) -m pip install -q httpx pillow transformers; \
	fi
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/strawq demo --fresh

test: $(STAMP)
	@deploy/juicefs/testvol.sh down "$(JFS_DIR)" >/dev/null 2>&1 || true
	@rm -rf "$(JFS_DIR)"
	@set -e; \
	if exports=$$(PATH="$(CURDIR)/$(VENV)/bin:$$PATH" deploy/juicefs/testvol.sh up "$(JFS_DIR)"); then \
	  eval "$$exports"; \
	else \
	  echo "JuiceFS test volume unavailable: the juicefs tests will skip and say why"; \
	fi; \
	rc=0; PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q $(PYTEST_ARGS) || rc=$$?; \
	deploy/juicefs/testvol.sh down "$(JFS_DIR)" >/dev/null 2>&1 || true; \
	exit $$rc

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/queue_ops.py
	$(PY) bench/engines.py
	$(PY) bench/collector.py
	$(PY) bench/integrations.py

clean:
	deploy/juicefs/testvol.sh down "$(JFS_DIR)" >/dev/null 2>&1 || true
	rm -rf "$(JFS_DIR)" $(VENV)
