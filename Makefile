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

bench: $(STAMP)
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) runs
