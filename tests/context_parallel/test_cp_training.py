"""Context-parallel training equals the one-process run: loss and grad norm per iteration, final weights.

20 iterations each, fp32, 1e-5 relative. One world per size; each rank trains every run (other
layouts get their groups built inside the same world): cp 2 and cp 4 alone with the ring (p2p),
Ulysses (a2a) and the hybrid, gpt2 and llama (RoPE, GQA), hidden dropout (masks follow the global
token position, so they equal the serial run's), ZeRO 3 keep mode and ZeRO 2 with the optimizer on
the host; tp2 x cp2 with sequence parallelism; cp2 x pp2 with GPipe, 1F1B and interleaved; cp2 x dp2
at ZeRO 1, 2 and 3; tp2 x cp2 x pp2 at ZeRO 3 with recompute. bf16 and fp16 (loss scaling) at cp 2
stay within half a unit roundoff of the serial run in the same precision.

Every run also checks that each block saw S/cp tokens per sample (CP active), and that the reported
TFLOP/s counts each token once over all devices (cp cannot inflate it).
"""
from __future__ import annotations

from megazero.config import Config, ConfigError
from megazero.model.flops import flops_per_token
from tests.helpers.compare import precision_errors
from tests.helpers.cp_runs import CPRun, make_cfg, run_many, serial_reference
from tests.helpers.dist import spawn
from tests.helpers.optimizer_harness import compare_runs

TOL = 1e-5
UNIT = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}  # unit roundoff of the compute precision


def check_guards(run: CPRun, result: dict, world: int) -> None:
    """Each block saw S/cp tokens per sample; TFLOP/s = FLOPs per token x global tokens / time / devices."""
    cfg = run.cfg
    p, m, t = cfg.parallel, cfg.model, cfg.training
    local = m.seq_length // p.cp // (p.tp if p.sequence_parallel else 1)
    assert result["block_tokens"] == [local], (run.key, result["block_tokens"], local)
    per_token = flops_per_token(m, t.recompute, t.recompute_num_layers)
    for r in result["records"]:
        expected = per_token * t.global_batch_size * m.seq_length / (r["step_time_ms"] / 1000) / world / 1e12
        assert abs(r["tflops_per_device"] - expected) <= 1e-9 * expected, (run.key, r, expected)


def check(results: list[dict], runs: list[CPRun]) -> None:
    bad = []
    for run in runs:
        ref = serial_reference(run.cfg)
        for rank, per_rank in enumerate(results):
            check_guards(run, per_rank[run.key], len(results))
            assert not any(r["skipped"] for r in per_rank[run.key]["records"]), run.key
            errs = compare_runs(per_rank[run.key], ref, run.key)
            worst = {k: v for k, v in errs.items() if not v <= TOL}
            if worst:
                bad.append(f"rank {rank}: {dict(sorted(worst.items(), key=lambda kv: -kv[1])[:4])}")
    assert not bad, "context-parallel run differs from serial:\n" + "\n".join(bad)


def test_cp2_ring_and_ulysses_match_serial():
    runs = [CPRun(f"{arch}.{comm}", make_cfg(arch, cp=2, comm=comm)) for arch in ("gpt2", "llama")
            for comm in ("p2p", "a2a")]
    runs += [CPRun("gpt2.p2p.dropout", make_cfg("gpt2", cp=2, dropout=0.1)),
             CPRun("llama.zero3.keep", make_cfg("llama", cp=2, zero=3, parallel=dict(reshard_after_forward=False))),
             CPRun("gpt2.zero2.host-optimizer", make_cfg("gpt2", cp=2, zero=2,
                                                         parallel=dict(offload_optimizer="cpu")))]
    low = {p: CPRun(f"llama.{p}", make_cfg("llama", cp=2, zero=1, training=flags))
           for p, flags in (("bf16", {"bf16": True}), ("fp16", {"fp16": True, "initial_loss_scale": 1024.0}))}
    results = spawn(run_many, 2, [*runs, *low.values()], cp=2)
    check(results, runs)
    for precision, run in low.items():  # against one process in the same precision
        errs = [precision_errors(per_rank[run.key], serial_reference(run.cfg)) for per_rank in results]
        assert max(max(e) for e in errs) <= UNIT[precision] / 2, (precision, errs)


def test_cp4_tp_pp_dp_zero_layouts_match_serial():
    runs = [CPRun("gpt2.cp4.p2p", make_cfg("gpt2", cp=4)),
            CPRun("llama.cp4.a2a", make_cfg("llama", cp=4, comm="a2a")),  # 2 kv heads replicated over 4
            CPRun("llama.cp4.hybrid", make_cfg("llama", cp=4, comm="a2a+p2p", a2a=2)),
            CPRun("llama.tp2cp2.sp", make_cfg("llama", tp=2, cp=2, sp=True)),
            CPRun("gpt2.cp2pp2.1f1b", make_cfg("gpt2", cp=2, pp=2)),
            CPRun("llama.cp2pp2.gpipe", make_cfg("llama", cp=2, pp=2, schedule="gpipe")),
            CPRun("llama.cp2pp2.interleaved", make_cfg("llama", cp=2, pp=2, layers=4, vp=2)),
            *[CPRun(f"gpt2.cp2dp2.zero{z}", make_cfg("gpt2", cp=2, zero=z), dp=2) for z in (1, 2, 3)]]
    check(spawn(run_many, 4, runs, cp=4), runs)


def test_tp2_cp2_pp2_zero3_recompute_match_serial():
    runs = [CPRun("llama.full", make_cfg("llama", tp=2, cp=2, pp=2, zero=3, sp=True, recompute="full")),
            CPRun("gpt2.selective", make_cfg("gpt2", tp=2, cp=2, pp=2, zero=3, recompute="selective"))]
    check(spawn(run_many, 8, runs, tp=2, cp=2, pp=2), runs)


def test_bad_cp_layouts_fail_with_one_line():
    from megazero.run_plan import RunPlan
    cases = {("--seq-length", "2 x --cp 3"): (lambda: make_cfg(cp=3, seq=32), 3),
             ("--cp-comm-type a2a", "heads"): (lambda: make_cfg(cp=8, comm="a2a"), 8),
             ("world size 6", "--tp 1 x --cp 4"): (lambda: make_cfg(cp=4), 6),
             ("--attention-dropout", "--cp 2"): (lambda: make_cfg(cp=2).updated(attention_dropout=0.1), 2),
             # a setting the run ignores is refused where settings arrive (flags, YAML, from_flat)
             ("--cp-a2a-size", "a2a+p2p"): (lambda: Config.from_flat({**make_cfg(cp=4).to_flat(), "cp_a2a_size": 2}),
                                            4),
             ("--cp-comm-type a2a+p2p", "--cp-a2a-size"): (lambda: make_cfg(cp=4, comm="a2a+p2p", a2a=4), 4),
             ("--seq-length", "--cp (2) with --sequence-parallel"): (lambda: make_cfg(tp=4, cp=2, sp=True,
                                                                                     seq=36), 8)}
    for (flag, why), (cfg_fn, world) in cases.items():
        try:
            RunPlan.resolve(cfg_fn(), world)
        except ConfigError as err:
            assert flag in str(err) and why in str(err) and "\n" not in str(err), str(err)
        else:
            raise AssertionError(f"{flag} accepted")
