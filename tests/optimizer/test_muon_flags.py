"""``--optimizer muon`` through pretrain_gpt.py: bad input refused in one line before any process group, the
layouts Muon is built for (optimizer offload included) accepted, and checkpoints across AdamW and Muon.

The NS flags reach the optimizer: one step of the ``DistributedOptimizer`` built from parsed
``--muon-ns-coefficients`` and ``--muon-ns-dtype bf16`` is ``torch.optim.Muon``'s with those coefficients (torch runs
NS in bf16), and ``--dry-run``'s Muon lines print the planner's NS workspace and traffic. The refusals are checked
in-process (every one of them runs before the process groups: ``prepare_run``); the
checkpoint cases launch real ranks: AdamW saves, Muon at dp 2 (ZeRO 1) resumes it with ``--no-load-optim`` and
saves every iteration, and a Muon resume from its own iteration-3 checkpoint gives iteration 4's loss and grad
norm bitwise; loading either optimizer's state into the other is refused naming ``--no-load-optim``.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from tests.helpers.launch import ROOT, train_records
from tests.helpers.refusals import refusal_line

SMALL = ["--arch", "gpt2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1",
         "--lr", "1e-3", "--lr-decay-style", "constant", "--adam-eps", "1e-4", "--train-iters", "2"]
MUON = ["--optimizer", "muon"]

BAD_INPUT = [  # (ranks, flags, the start of the one line after "pretrain_gpt.py: error: ")
    (1, ["--muon-momentum", "0.9"], "--muon-momentum 0.9 only applies with --optimizer muon (here --optimizer "
                                    "adamw); drop it or pass --optimizer muon."),
    (1, ["--no-muon-nesterov"], "--no-muon-nesterov only applies with --optimizer muon"),
    (1, ["--muon-ns-steps", "3"], "--muon-ns-steps 3 only applies with --optimizer muon"),
    (1, ["--muon-lr-adjust", "match_rms_adamw"], "--muon-lr-adjust match_rms_adamw only applies with --optimizer muon"),
    (1, ["--muon-adam-lr", "1e-3"], "--muon-adam-lr 0.001 only applies with --optimizer muon"),
    (1, ["--muon-ns-coefficients", "3", "-4", "2"], "--muon-ns-coefficients 3.0 -4.0 2.0 only applies with "
                                                    "--optimizer muon"),
    (1, ["--muon-ns-dtype", "bf16"], "--muon-ns-dtype bf16 only applies with --optimizer muon"),
    (1, [*MUON, "--muon-momentum", "1"], "--muon-momentum must be in [0, 1), got 1.0"),
    (1, [*MUON, "--muon-momentum=-0.1"], "--muon-momentum must be in [0, 1), got -0.1"),
    (1, [*MUON, "--muon-ns-steps", "0"], "--muon-ns-steps must be in [1, 99], got 0"),
    (1, [*MUON, "--muon-adam-lr=-1e-3"], "--muon-adam-lr must be >= 0, got -0.001"),
    (1, [*MUON, "--muon-adam-lr", "1e-3", "--lr", "0", "--min-lr", "0"], "--muon-adam-lr follows the --lr schedule"),
    (1, [*MUON, "--muon-ns-coefficients", "3", "-4"], "argument --muon-ns-coefficients: expected 3 arguments"),
    (1, [*MUON, "--muon-ns-coefficients", "0", "-4", "2"], "--muon-ns-coefficients must be three finite numbers "
                                                           "a b c with a > 0"),
    (1, [*MUON, "--muon-ns-coefficients", "3", "nan", "2"], "--muon-ns-coefficients must be three finite numbers"),
    (1, [*MUON, "--muon-ns-dtype", "fp16"], "argument --muon-ns-dtype: invalid choice: 'fp16'"),
    (1, [*MUON, "--muon-lr-adjust", "spectral"], "argument --muon-lr-adjust: invalid choice: 'spectral'"),
    (1, ["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'"),
]


def _refusal_line(nproc: int, flags: list[str]) -> str:
    return refusal_line([*SMALL, *flags], nproc)


@pytest.mark.parametrize("nproc,flags,start", BAD_INPUT, ids=[" ".join(b[1]) for b in BAD_INPUT])
def test_bad_muon_input_is_refused_in_one_line(nproc, flags, start):
    line = _refusal_line(nproc, flags)
    assert "\n" not in line.strip(), line
    assert line.startswith("pretrain_gpt.py: error: " + start), line


def test_the_layouts_muon_is_built_for_pass_the_checks():
    from megazero.arguments import parse_config
    from megazero.run_plan import RunPlan

    for nproc, flags in ((2, ["--zero", "2"]), (2, ["--tp", "2", "--sequence-parallel", "--zero", "1"]),
                         (4, ["--tp", "2", "--zero", "0", "--bf16"]), (2, ["--zero", "1", "--fp16"]),
                         (2, ["--pp", "2"]), (2, ["--cp", "2"]), (1, ["--num-experts", "2"]),
                         (4, ["--num-experts", "2", "--ep", "2", "--pp", "2", "--zero", "1"]),
                         (2, ["--zero", "1", "--offload-optimizer", "cpu"]),
                         (2, ["--zero", "2", "--offload-optimizer", "disk", "--offload-path", "off"])):
        cfg = parse_config([*SMALL, *MUON, *flags])[0]
        cfg.refuse_inapplicable()
        RunPlan.resolve(cfg, nproc)


NS_FLAGS = ["--muon-ns-coefficients", "2", "-1.5", "0.5"]  # not the default: a step shows which ones ran
ONE_STEP = [*SMALL, *MUON, "--vocab-size", "128", "--lr", "0.02", "--clip-grad", "0"]


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 33), generator=torch.Generator().manual_seed(5))


def _trained_model(cfg):
    """The model ``pretrain_gpt.py`` builds from ``cfg`` (one process), with one batch's gradients."""
    from megazero.model.gpt import GPTModel
    from megazero.model.transformer import TPContext
    from megazero.tensor_parallel.layers import initialize_parameters

    model = GPTModel(cfg.model, TPContext(group=None))
    initialize_parameters(model, cfg.training.seed, None)
    return model


def _our_muon_update(argv: list[str]) -> dict[str, torch.Tensor]:
    """Each Muon weight's change in one step of the ``DistributedOptimizer`` built from the parsed flags."""
    from megazero.arguments import parse_config
    from megazero.data_parallel.engine import EngineSettings, GradSyncEngine
    from megazero.optimizer.muon import split_parameters
    from megazero.optimizer.zero import DistributedOptimizer
    from megazero.parallel.state import ParallelState

    cfg = parse_config(argv)[0]
    model = _trained_model(cfg)
    names = {p: n for n, p in model.named_parameters()}
    optimizer = DistributedOptimizer(GradSyncEngine([model], ParallelState.serial(), EngineSettings(bucket_size=3000)),
                                     cfg.optimizer, muon=(cfg.model, names))
    before = {n: p.detach().clone() for n, p in split_parameters(model.named_parameters())[0]}
    tokens = _tokens(cfg.model.vocab_size)
    optimizer.zero_grad()
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step(cfg.optimizer.lr)
    return {n: p.detach() - before[n] for n, p in model.named_parameters() if n in before}


def _torch_muon_update(argv: list[str], coefficients: tuple[float, float, float]) -> dict[str, torch.Tensor]:
    """The same step by ``torch.optim.Muon`` (NS in bf16, as shipped) on the unfused matrices."""
    from megazero.arguments import parse_config
    from megazero.optimizer.muon import matrices_of, merge_matrices, split_matrices, split_parameters

    cfg = parse_config(argv)[0]
    model = _trained_model(cfg)
    tokens = _tokens(cfg.model.vocab_size)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    muon_named = split_parameters(model.named_parameters())[0]
    layout = {n: matrices_of(n, p.shape, cfg.model) for n, p in muon_named}
    pieces = {n: [torch.nn.Parameter(t) for t in split_matrices(p.detach(), layout[n])] for n, p in muon_named}
    for n, p in muon_named:
        for piece, grad in zip(pieces[n], split_matrices(p.grad, layout[n])):
            piece.grad = grad
    o = cfg.optimizer
    torch.optim.Muon([t for ts in pieces.values() for t in ts], lr=o.lr, weight_decay=o.weight_decay,
                     momentum=o.muon_momentum, ns_coefficients=coefficients, adjust_lr_fn=o.muon_lr_adjust).step()
    return {n: merge_matrices([t.detach() for t in pieces[n]], layout[n], torch.empty_like(p)) - p.detach()
            for n, p in muon_named}


def _worst_rel_err(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    assert ours.keys() == theirs.keys() and ours
    return max(float((ours[n] - theirs[n]).norm() / theirs[n].norm()) for n in ours)


def test_ns_flags_reach_the_optimizer():
    from megazero.arguments import parse_config
    from megazero.optimizer.muon import muon_hyper

    default = muon_hyper(parse_config(ONE_STEP)[0].optimizer, 0.02)
    torch_default = torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))]).defaults["ns_coefficients"]
    assert default.ns_coefficients == torch_default and default.ns_dtype == torch.float32
    hyper = muon_hyper(parse_config([*ONE_STEP, *NS_FLAGS, "--muon-ns-dtype", "bf16"])[0].optimizer, 0.02)
    assert hyper.ns_coefficients == (2.0, -1.5, 0.5) and hyper.ns_dtype == torch.bfloat16
    theirs = _torch_muon_update(ONE_STEP, (2.0, -1.5, 0.5))
    assert _worst_rel_err(_our_muon_update([*ONE_STEP, *NS_FLAGS, "--muon-ns-dtype", "bf16"]), theirs) < 1e-6
    assert _worst_rel_err(_our_muon_update([*ONE_STEP, *NS_FLAGS]), theirs) > 1e-3  # fp32 NS: not torch's bf16
    assert _worst_rel_err(_our_muon_update([*ONE_STEP, "--muon-ns-dtype", "bf16"]), theirs) > 1e-2  # torch's a, b, c


DRY_RUN = ["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "--optimizer", "muon", "--dry-run", "--dp", "4",
           "--zero", "1", "--recompute", "none"]


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # main's @record under capsys
def test_dry_run_muon_lines_are_the_planners(capsys):
    import pretrain_gpt
    from megazero.memory import with_vocabulary
    from megazero.memory.muon_plan import ns_workspace_bytes, one_moment_saving
    from megazero.memory.muon_traffic import muon_step_bytes
    from megazero.run_plan import RunPlan

    assert pretrain_gpt.main(DRY_RUN) == 0
    out = capsys.readouterr().out
    state = re.search(r"optimizer: muon; state one fp32 moment per Muon-trained element .* NS workspace of the "
                      r"largest matrix ([\d.]+) MiB \(2mn \+ 2m\^2 fp32", out)
    traffic = re.search(r"muon traffic: its owner gathers and scatters send ([\d.]+) MiB per step", out)
    assert state and traffic, out
    cfg = with_vocabulary(pretrain_gpt._parse(DRY_RUN)[0])
    run = RunPlan.resolve(cfg, 4)
    layers = list(range(cfg.model.num_layers))
    h = cfg.model.hidden_size  # gpt2: the largest matrix is fc1/fc2, 4h x h: 2 (4h) h + 2 h^2 fp32
    assert ns_workspace_bytes(cfg, layers) == 4 * (2 * 4 * h * h + 2 * h * h)
    assert state.group(1) == f"{ns_workspace_bytes(cfg, layers) / 2**20:.2f}"
    assert traffic.group(1) == f"{muon_step_bytes(cfg, run, 0) / 2**20:.2f}" and muon_step_bytes(cfg, run, 0) > 0
    muon_elements = cfg.model.num_layers * (3 * h * h + h * h + 2 * 4 * h * h)  # qkv, proj, fc1, fc2
    assert one_moment_saving(cfg, run, layers) == 4 * muon_elements / 4  # one moment fewer, sharded over dp 4
    # NS in bf16 (torch.optim.Muon's dtype): the same matrix at 2 bytes an element, and the line says so
    assert pretrain_gpt.main([*DRY_RUN, "--muon-ns-dtype", "bf16"]) == 0
    half = re.search(r"NS workspace of the largest matrix ([\d.]+) MiB \(2mn \+ 2m\^2 bf16", capsys.readouterr().out)
    bf16 = with_vocabulary(pretrain_gpt._parse([*DRY_RUN, "--muon-ns-dtype", "bf16"])[0])
    assert ns_workspace_bytes(bf16, layers) == 2 * (2 * 4 * h * h + 2 * h * h)
    assert half and half.group(1) == f"{ns_workspace_bytes(bf16, layers) / 2**20:.2f}"


def _train(tmp, name: str, nproc: int, flags: list[str]) -> list[dict]:
    return train_records(os.path.join(tmp, f"{name}.jsonl"), [*SMALL, *flags], nproc)


def test_checkpoints_across_adamw_and_muon(tmp_path):
    adamw, muon = str(tmp_path / "adamw"), str(tmp_path / "muon")
    _train(tmp_path, "adamw", 1, ["--save", adamw])
    line = _refusal_line(2, [*MUON, "--zero", "1", "--load", adamw, "--train-iters", "4"])
    assert line == (f"pretrain_gpt.py: error: --optimizer muon cannot load the adamw optimizer state of --load "
                    f"{adamw}; pass --no-load-optim to start muon's state fresh from the loaded weights, or "
                    f"--optimizer adamw."), line
    import pretrain_gpt
    from megazero.training.run import prepare_run

    cfg, _ = pretrain_gpt._parse([*SMALL, *MUON, "--load", adamw, "--finetune", "--train-iters", "4"])
    assert prepare_run(cfg, 1, None, lambda _: None) is not None  # --finetune reads no optimizer state
    resumed = _train(tmp_path, "muon", 2, [*MUON, "--zero", "1", "--load", adamw, "--no-load-optim",
                                           "--train-iters", "4", "--save", muon, "--save-interval", "1"])
    assert [r["iteration"] for r in resumed] == [3, 4]
    line = _refusal_line(2, ["--zero", "1", "--load", muon, "--train-iters", "6"])
    assert line.startswith("pretrain_gpt.py: error: --optimizer adamw cannot load the muon optimizer state of "
                           "--load") and "--no-load-optim" in line, line
    again = _train(tmp_path, "again", 2, [*MUON, "--zero", "1", "--load", os.path.join(muon, "iter_0000003"),
                                          "--train-iters", "4"])
    assert [(r["iteration"], r["loss"], r["grad_norm"]) for r in again] == \
        [(r["iteration"], r["loss"], r["grad_norm"]) for r in resumed[1:]]

