"""Page faults per training step with glibc's defaults and with ``keep_freed_host_memory()``.

`.venv/bin/python -m bench.bench_host_memory` runs 10 serial steps of a 2-layer GPT in a fresh process
per mode and prints the minor page faults each took. A count depends on the machine and its
load, so it is measured here and never asserted in the test suite (which checks only the
mechanism: ``tests/training/test_host_memory.py``).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from bench.results import results_header

SCRIPT = """
import resource, sys, time, torch
torch.set_num_threads(1)
if sys.argv[1] == "tuned":
    from megazero.training.host_memory import keep_freed_host_memory
    assert keep_freed_host_memory()
from megazero.config import ModelConfig
from megazero.model.gpt import GPTModel
from megazero.model.transformer import TPContext
torch.manual_seed(0)
model = GPTModel(ModelConfig(arch="gpt2", num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128,
                             vocab_size=4096), TPContext())
tokens = torch.randint(0, 4096, (4, 129))
def step():
    model(tokens[:, :-1], tokens[:, 1:]).backward()
step(); step()
before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, (time.perf_counter() - start) / 10)
"""


def measure(mode: str) -> tuple[int, float]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    faults, seconds = out.stdout.split()
    return int(faults), float(seconds)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(results_header("bench.bench_host_memory") + "\n")
    for mode in ("default", "tuned"):
        faults, seconds = measure(mode)
        print(f"{mode:8s} {faults / 10:10.0f} page faults/step  {1000 * seconds:8.1f} ms/step")


if __name__ == "__main__":
    main()
