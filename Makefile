# Every target sets itself up: a fresh clone needs only `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ds_lightning-installed
DOCS_STAMP := $(VENV)/.ds_lightning-docs-installed
# The pinned torch resolves to the CPU wheel on CPU-only machines here; a GPU box may override it.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# The example configs say `accelerator: auto` and `devices: auto`: every GPU of a GPU machine, but one process on a CPU.
# So that the demos have two processes to distribute over there, they add DEMO_ARGS, which is empty where torch sees a
# CUDA device and `--trainer.accelerator=cpu --trainer.devices=2` otherwise (read when a demo runs, after setup);
# set it to choose, e.g. `make demo DEMO_ARGS=--trainer.devices=4`.
DEMO_ARGS ?= $(shell $(PY) -c "import torch; print('' if torch.cuda.is_available() else \
	'--trainer.accelerator=cpu --trainer.devices=2')" 2>/dev/null || echo --trainer.accelerator=cpu --trainer.devices=2)
# `make test` runs on two pytest-xdist workers, one per core here: a multi-rank test spends much of its time waiting
# (rendezvous, timeouts, a killed rank), so two at once keep both cores busy. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

.PHONY: setup cluster-tools demo demo-gpt test test-gpu test-versions lint docs bench bench-all clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Install torch first and pinned: an open range with no torch present can pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/ds-train fit --config examples/configs/mirrored.yaml $(DEMO_ARGS)

# The byte-level GPT on the standard library's own source text under ds_mirrored, a few minutes on 2 CPU cores; prints
# the validation perplexity, tokens/s and a sample of the text it writes (docs/gpt.md).
demo-gpt: setup
	$(VENV)/bin/ds-train fit --config examples/configs/gpt_mirrored.yaml $(DEMO_ARGS)

test: setup cluster-tools
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

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
	$(PY) -m benchmarks.precision.driver --quick

test-versions: setup
	bash .ci/versions

# The multi-host tests build namespace clusters with iproute2 (ip, tc, ss), and a SLURM cluster on them with Debian's
# slurm-wlm and munge (tests/cluster/test_slurm.py); as root, install what is missing. Without it (or without root)
# those tests skip and say what is missing; .ci/run makes such a skip a failure.
CLUSTER_PACKAGES := iproute2 slurm-wlm munge
cluster-tools:
	@missing=""; \
	for tool in ip tc ss; do command -v $$tool >/dev/null || missing="iproute2"; done; \
	for tool in slurmctld slurmd sbatch srun scontrol munged; do \
	  command -v $$tool >/dev/null || missing="$$missing slurm-wlm munge"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $(CLUSTER_PACKAGES) for the multi-host cluster tests"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(CLUSTER_PACKAGES) >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
	        apt-get install -y -q --no-install-recommends $(CLUSTER_PACKAGES) >/dev/null 2>&1; } || \
	      echo "note: could not install $(CLUSTER_PACKAGES); the cluster tests will skip"; \
	  else echo "note: $$missing missing and this is not root; the cluster tests will skip"; fi; fi

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

# One target per benchmark and workload (benchmarks/<name>/README.md); `make bench-all` runs every one in turn, going on
# past a failed one, then writes benchmarks/results/bench_all.{json,md}: each target's minutes and exit status, every
# target's verdict, each results file's commit (flagged where they differ) and the total against the 2-hour budget
# (benchmarks/harness/bench_all.py; BENCH_ALL_ARGS="--summary-only" runs nothing, "--targets T ..." some). The
# cluster targets need root; without it they print why they are skipped and succeed.
BENCH_TARGETS := bench-mirrored bench-mirrored-gpt bench-pipeline bench-pipeline-gpt bench-ps bench-ps-gpt \
	bench-balance bench-balance-gpt bench-precision bench-precision-gpt bench-precision-ops bench-memory bench-memory-gpt bench-sharding \
	bench-sharding-gpt bench-collectives bench-faults bench-cluster bench-cluster-gpt bench-cluster-hierarchical \
	bench-cluster-hierarchical-gpt bench-report bench-link
.PHONY: $(BENCH_TARGETS)

bench: bench-mirrored

BENCH_ALL_ARGS ?=
bench-all: setup
	$(PY) -m benchmarks.harness.bench_all $(BENCH_ALL_ARGS)

# bench-<name> runs benchmarks/<folder>/driver.py on the digits, bench-<name>-gpt on the GPT (<name>=<folder> below):
# mirrored (ds_mirrored vs ddp, gradient_compression), pipeline (vs hand-written pipelining), ps (parameter server
# under a straggler), balance (DynamicLoadBalancer), memory (optimizer-state sharding), sharding (ZeRO vs FSDP2 in plain
# torch), collectives (gloo reduce-scatter / all-gather), faults (BackupAndRestore; its netns part as root), report
# (DistributedReport's overhead).
BENCH_FOLDERS := mirrored=mirrored pipeline=pipeline ps=parameter_server balance=load_balance memory=memory \
	sharding=sharding_engines collectives=collectives faults=faults report=report_overhead
bench_folder = $(patsubst $(1)=%,%,$(filter $(1)=%,$(BENCH_FOLDERS)))

$(addprefix bench-,mirrored pipeline ps balance sharding collectives faults report): bench-%: setup
	$(PY) -m benchmarks.$(call bench_folder,$*).driver

$(addprefix bench-,$(addsuffix -gpt,mirrored pipeline ps balance sharding)): bench-%-gpt: setup
	$(PY) -m benchmarks.$(call bench_folder,$*).driver --model gpt

# ds_mirrored's sharding modes beside Lightning's FSDPStrategy and DeepSpeedStrategy (benchmarks/memory/); the GPT run
# adds the largest-model ladder under a per-process cgroup cap (root). DeepSpeed, for its arm only, goes into
# $(BENCH_EXTRA), not the venv; where it does not install, the arm records why it could not run.
BENCH_EXTRA := $(VENV)/bench-extra
$(BENCH_EXTRA): $(STAMP)
	-DS_BUILD_OPS=0 $(PY) -m pip install -q --no-deps --no-build-isolation --target $(BENCH_EXTRA) deepspeed==0.19.8 \
		hjson ninja py-cpuinfo msgpack einops nvidia-ml-py

bench-memory: setup $(BENCH_EXTRA)
	$(PY) -m benchmarks.memory.driver --extra-path $(BENCH_EXTRA)

bench-memory-gpt: setup $(BENCH_EXTRA)
	$(PY) -m benchmarks.memory.driver --model gpt --extra-path $(BENCH_EXTRA)

# MixedPrecision: fp32 against bf16, fp16 and auto
bench-precision: setup
	$(PY) -m benchmarks.precision.driver

bench-precision-gpt: setup
	$(PY) -m benchmarks.precision.driver --model gpt

# torch.profiler op by op, fp32 against bf16, on the GPT (no harness JSON: a markdown table)
bench-precision-ops: setup
	$(PY) -m benchmarks.precision.ops

# The network-namespace cluster (root): parts 1-3, the GPT's part 1, and part 4 (two-level all-reduce) on both
bench-cluster: setup cluster-tools
	$(PY) -m benchmarks.cluster.driver --parts compression ps balance

bench-cluster-gpt: setup cluster-tools
	$(PY) -m benchmarks.cluster.driver --model gpt

bench-cluster-hierarchical: setup cluster-tools
	$(PY) -m benchmarks.cluster.driver --parts hierarchical

bench-cluster-hierarchical-gpt: setup cluster-tools
	$(PY) -m benchmarks.cluster.driver --model gpt --parts hierarchical

# DistributedReport on the namespace cluster (root): host 2's link at a tenth of the others' bandwidth, against equal
# links; is the step time it adds attributed to that link (benchmarks/link_attribution/)?
bench-link: setup cluster-tools
	$(PY) -m benchmarks.link_attribution.driver

clean:
	rm -rf $(VENV) lightning_logs runs .pytest_cache .ruff_cache .mypy_cache
