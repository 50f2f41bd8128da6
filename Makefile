# `make train` and `make test` work on a fresh machine with only Python: they create .venv,
# install torch==2.13.0 first (the exact pin keeps pip from pulling CUDA wheels), then the project.
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 4
STAMP  := $(VENV)/.megazero-installed

.PHONY: setup train test test-quick lint bench gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,lint]'
	touch $(STAMP)

# Trains from scratch every time: the previous run's runs/tiny (metrics, checkpoints) is removed first. It
# evaluates every 40 steps and at the last one, and saves the last step where docs/generation.md samples from.
train: $(STAMP)
	rm -rf runs/tiny
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) pretrain_gpt.py \
		--config configs/tiny.yaml --tp 2 --eval-interval 40 --metrics-file runs/tiny/metrics.jsonl \
		--save runs/tiny/checkpoints

# test: everything. test-quick: the tests that start no process of their own (tests/helpers/tiers.py marks each
# test by what it uses), less the modules over 20 CPU-seconds (``heavy``, tests/helpers/suite_order.py), for
# before each commit. Both run TEST_WORKERS pytest processes (pytest-xdist; auto = one
# per core), which steal tests from each other at the end. PYTEST_ARGS adds pytest flags (.ci/run: timings).
# The suite starts ~100 fresh interpreters (torchrun agents, signals, doc commands): each would compile megazero's
# sources again where the environment sets PYTHONDONTWRITEBYTECODE, so the tests write bytecode into the (ignored)
# __pycache__ folders, and pytest caches its rewritten test modules there.
TEST_WORKERS ?= auto
XDIST := -n $(TEST_WORKERS) --dist worksteal
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

test: $(STAMP)
	$(PYTEST) tests -q $(XDIST) $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(PYTEST) tests -q -m "not launch and not heavy" $(XDIST) $(PYTEST_ARGS)

# ruff (pyflakes, pycodestyle, bugbear; settings in pyproject.toml) on everything, and mypy on megazero/ against
# the committed baseline .ci/mypy-baseline.txt, which may only shrink (.ci/type_baseline.py says how).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) .ci/type_baseline.py

BENCH_STAMP := $(VENV)/.megazero-bench-installed

# Peers install with --no-deps: their own requirements would replace torch==2.13.0 with a CUDA build.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q hjson msgpack ninja psutil py-cpuinfo pydantic tqdm
	$(PY) -m pip install -q --no-deps deepspeed==0.19.8 megatron-core==0.16.1
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m bench.run

# The CUDA-marked tests (tests/cuda) and bench.gpu_mfu, run by the first of the venv's python and python3
# whose torch sees a GPU (a GPU machine's own torch is often the system one). Without one it says so and
# exits 0. docs/gpu.md says what it checks.
CUDA_PROBE := import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)

gpu-check:
	@py=""; for c in $(PY) python3; do \
		if command -v $$c >/dev/null 2>&1 && $$c -c "$(CUDA_PROBE)" 2>/dev/null; then py=$$c; break; fi; \
	done; \
	if [ -z "$$py" ]; then \
		echo "gpu-check: skipped: no CUDA GPU visible to $(PY) or python3 (torch.cuda.is_available() is False)"; \
		exit 0; \
	fi; \
	echo "gpu-check: $$py, $$($$py -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))')"; \
	PYTHONPATH=. $$py -m pytest tests/cuda -m cuda -v -rs && $$py -m bench.gpu_mfu

clean:
	rm -rf $(VENV) runs
