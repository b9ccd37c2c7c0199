# Every target sets itself up: a fresh clone needs only `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ds_lightning-installed
DOCS_STAMP := $(VENV)/.ds_lightning-docs-installed
# The pinned torch resolves to the CPU wheel on CPU-only machines here; a GPU box may override it.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup cluster-tools demo demo-gpt test test-gpu test-versions lint docs bench bench-pipeline bench-ps bench-balance bench-precision bench-cluster bench-faults bench-memory bench-collectives bench-sharding clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Install torch first and pinned: an open range with no torch present can pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/ds-train fit --config examples/configs/mirrored.yaml

# The byte-level GPT on the standard library's own source text under ds_mirrored, a few minutes on 2 CPU cores; prints
# the validation perplexity, tokens/s and a sample of the text it writes (docs/gpt.md).
demo-gpt: setup
	$(VENV)/bin/ds-train fit --config examples/configs/gpt_mirrored.yaml

test: setup cluster-tools
	$(PY) -m pytest $(PYTEST_ARGS)

# The declared dependency ranges at their ends (and the pinned venv): every example config and every strategy, on
# venvs cached under ~/.cache/ds_lightning/versions. Writes runs/versions/matrix.md.
# The CUDA tests (tests/gpu, marked `cuda`) and the precision benchmark's quick mode, on a GPU machine (under 10
# minutes on one H200). No visible CUDA device is an error here, not a skip. A GPU box may need TORCH_SPEC set to a
# CUDA build of torch, e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
test-gpu: setup
	@$(PY) -c "import sys, torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; \
	  print(f'test-gpu: {n} CUDA device(s), torch {torch.__version__}, CUDA build {torch.version.cuda}'); \
	  sys.exit(0 if n else 'test-gpu: FAILED: no CUDA device is visible (torch.cuda.is_available() is False)')"
	DS_LIGHTNING_REQUIRE_CUDA=1 $(PY) -m pytest -m cuda tests/gpu $(PYTEST_ARGS)
	$(PY) benchmarks/precision.py --quick

test-versions: setup
	bash .ci/versions

# The multi-host tests build namespace clusters with iproute2 (ip, tc, ss); as root, install it when missing.
# Without it (or without root) those tests skip and say what is missing.
cluster-tools:
	@command -v ip >/dev/null && command -v tc >/dev/null && command -v ss >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing iproute2 for the multi-host cluster tests"; \
	    apt-get install -y -q iproute2 >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iproute2 >/dev/null 2>&1; } || \
	      echo "note: could not install iproute2; the cluster tests will skip"; \
	  else echo "note: iproute2 is missing and this is not root; the cluster tests will skip"; fi; }

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# The site goes to site/; --strict makes a broken link or an unresolved API reference fail the build.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	touch $(DOCS_STAMP)

bench: setup
	$(PY) benchmarks/mirrored.py

bench-pipeline: setup
	$(PY) benchmarks/pipeline.py

bench-ps: setup
	$(PY) benchmarks/parameter_server.py

bench-balance: setup
	$(PY) benchmarks/load_balance.py

bench-precision: setup
	$(PY) benchmarks/precision.py

bench-cluster: setup cluster-tools
	$(PY) benchmarks/cluster.py

bench-faults: setup
	$(PY) benchmarks/faults.py

bench-memory: setup
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/memory.py --model gpt

bench-collectives: setup
	$(PY) benchmarks/collectives.py

bench-sharding: setup
	$(PY) benchmarks/sharding_engines.py
	$(PY) benchmarks/sharding_engines.py --model gpt

clean:
	rm -rf $(VENV) lightning_logs runs .pytest_cache .ruff_cache .mypy_cache
