"""The allocator tuning removes the page faults of re-allocating a step's tensors every step."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import resource, sys, torch
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
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_a_training_step_reuses_freed_memory():
    default, tuned = faults("default"), faults("tuned")
    assert default > 5000, f"glibc's defaults should fault pages back in every step ({default} over 10)"
    assert tuned < default, f"with the tuning fewer pages are faulted back in ({tuned} vs {default} faults)"
