# `make train` and `make test` work on a fresh machine with only Python: they create .venv,
# install torch==2.13.0 first (the exact pin keeps pip from pulling CUDA wheels), then the project.
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 4
STAMP  := $(VENV)/.megazero-installed

.PHONY: setup train test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) pretrain_gpt.py \
		--config configs/tiny.yaml --tp 2 --metrics-file runs/tiny/metrics.jsonl

test: $(STAMP)
	$(PY) -m pytest tests -q

BENCH_STAMP := $(VENV)/.megazero-bench-installed

# Peers install with --no-deps: their own requirements would replace torch==2.13.0 with a CUDA build.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q hjson msgpack ninja psutil py-cpuinfo pydantic tqdm
	$(PY) -m pip install -q --no-deps deepspeed==0.19.8 megatron-core==0.16.1
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	OMP_NUM_THREADS=1 $(PY) bench/run.py

clean:
	rm -rf $(VENV) runs
