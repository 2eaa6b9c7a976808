# Entry points, each setting everything up first: `make demo` (the main job), `make test`, `make test-fast`, `make lint`,
# `make bench`, `make bench-quick`, `make soak`, `make results` and, on a CUDA machine, `make gpu-check`.
# TORCH is installed before the package so pip never resolves an unpinned torch to the CUDA build;
# on a GPU machine use e.g. `make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"`.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
DEMO   ?= runs/demo

.PHONY: setup demo test test-fast lint bench bench-quick soak soak-s3 results gpu-check clean

# Every target also compiles the tree's Python once: with PYTHONDONTWRITEBYTECODE set (as on the CI machines) each
# process would otherwise compile every module of the package it imports, 1.5 s of CPU per rank (docs/testing.md).
setup: $(VENV)/.installed
	$(PY) -m compileall -q -j 0 replay tests examples results benchmarks

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,lint]'
	touch $@

# The whole story on the embedded default: record the `spike` preset on 2 CPU ranks, bisect its spike,
# replay and analyse it on a local Ray cluster, write the report (stages already done in DEMO are reused).
demo: setup
	$(VENV)/bin/replay demo --out $(DEMO)

# On two worker processes, a test file at a time to whichever is free (docs/testing.md). The benchmarks' quick
# runs are `make bench-quick`, beside it in CI.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not benchmark" --durations=15

# Every benchmark in its quick mode (seconds each), so none of them rots between `make bench` runs.
bench-quick: setup
	$(PY) -m pytest -q -n 2 -m benchmark

# The edit loop: the unit tests only, in this process (docs/testing.md).
# The unit tests on two workers; the integration tests' files are not even imported (their modules import
# Lightning, Ray, DeepSpeed: most of a collection's 18 s).
test-fast: setup
	$(PY) -m pytest -q -n 2 -m "not integration" --ignore-glob="*_integration.py"

# ruff (pyflakes, pycodestyle, isort, bugbear, pyupgrade) over the tree and mypy over the package, strict on
# replay.store and replay.bisect (pyproject.toml says how).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The papers' headline results at laptop scale, with the product's own commands, into docs/results.md
# (plots beside it); run stores go to runs/results and are reused by a rerun. About 13 minutes on 2 cores.
results: setup
	$(PY) -m results.make_results

# The fault soak: 30 SIGKILLs of a 2-rank recording at random moments (each resumed and compared bit for bit
# with an uninterrupted run), then single-bit flips all over every file of a checkpoint, then analyze, report,
# export and bisect each SIGKILLed at random moments and run on a full disk (a tmpfs it mounts: root), each
# run again after and compared with an uninterrupted run; prints the counts.
soak: setup
	$(PY) -m tests.soak

# The same soak with every store in the bucket of a SeaweedFS S3 server on 127.0.0.1 (tests/s3server.py).
soak-s3: setup
	$(PY) -m tests.soak --s3

bench: setup
	$(PY) benchmarks/bench_record.py
	$(PY) benchmarks/bench_replay.py
	$(PY) benchmarks/bench_fewer_ranks.py
	$(PY) benchmarks/bench_multinode.py
	$(PY) benchmarks/bench_analysis.py
	$(PY) benchmarks/bench_bisect.py
	$(PY) benchmarks/bench_attention.py
	$(PY) benchmarks/bench_loader.py
	$(PY) benchmarks/bench_sharded.py
	$(PY) benchmarks/bench_dcp.py
	$(PY) benchmarks/bench_object_store.py

# Every GPU test and GPU measurement (a CUDA GPU; see docs/gpu.md), into runs/gpu-check/report.md.
gpu-check: setup
	$(PY) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) runs
