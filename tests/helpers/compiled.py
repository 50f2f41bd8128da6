"""The check every --compile test makes: a compiled model trains as its eager twin."""
from __future__ import annotations

import torch


def assert_two_steps_match(eager: torch.nn.Module, compiled: torch.nn.Module) -> None:
    """Two forward + backward steps of both models on the same seeded tokens (vocabulary 128, 16 positions):
    the same losses (1e-6) and accumulated gradients (1e-5)."""
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # a second step runs on advanced dropout streams and accumulated gradients
        losses = [m(tokens[:, :-1], tokens[:, 1:]) for m in (eager, compiled)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
