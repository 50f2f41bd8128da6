"""Mixture-of-experts settings (issue 33): each bad combination is refused in one line naming the flag and the fix.

Pure config and run-plan checks, no process started: the flags through ``parse_config`` (as
pretrain_gpt.py reads them), YAML spellings of ``--moe-layer-freq``, the run plan's checks against the
world (--ep dividing E, the expert grid folding, sequence parallelism under TP), and a checkpoint's model
settings with and without the MoE fields.
"""
from __future__ import annotations

from dataclasses import fields

import pytest

from megazero.arguments import build_parser, parse_config
from megazero.checkpoint.load import merge_config
from megazero.config import Config, ConfigError, ModelConfig
from megazero.moe_config import MoEFields
from megazero.run_plan import RunPlan
from megazero.training.run import validate

MOE = ["--num-experts", "8"]


def _refusal(argv: list[str], world: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        RunPlan.resolve(parse_config(argv)[0], world)
    message = str(err.value)
    assert "\n" not in message
    return message


# a value off the default for every MoE flag (the --moe-token-drop-policy/pad pair need a capacity: tested below)
OFF_DEFAULT = {"moe_router_topk": "4", "moe_ffn_hidden_size": "64", "moe_layer_freq": "2",
               "moe_shared_expert_intermediate_size": "64", "moe_router_score_function": "sigmoid",
               "moe_router_pre_softmax": None, "moe_router_topk_scaling_factor": "2.5", "moe_router_num_groups": "2",
               "moe_router_group_topk": "1", "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": "0.01",
               "moe_z_loss_coeff": "0.001", "moe_router_enable_expert_bias": None, "moe_router_force_balance": None,
               "moe_expert_capacity_factor": "1.5", "expert_model_parallel_size": "2",
               "expert_tensor_parallel_size": "2", "moe_token_dispatcher_type": "allgather"}


def test_every_moe_flag_is_covered_here():
    moe = {f.name for f in fields(MoEFields)} - {"num_experts", "moe_router_bias_update_rate",
                                                  "moe_token_drop_policy", "moe_pad_expert_input_to_capacity"}
    assert moe | {"expert_model_parallel_size", "expert_tensor_parallel_size", "moe_token_dispatcher_type"} \
        == set(OFF_DEFAULT)


@pytest.mark.parametrize("name", sorted(OFF_DEFAULT))
def test_a_moe_flag_without_num_experts_is_refused(name):
    option = "--" + name.replace("_", "-")
    argv = [option] if OFF_DEFAULT[name] is None else [option, OFF_DEFAULT[name]]
    with pytest.raises(ConfigError) as err:
        parse_config(argv)
    message = str(err.value)
    assert message.startswith(option) and "\n" not in message
    assert message.endswith("only applies with --num-experts E (here no --num-experts); drop it or pass "
                            "--num-experts E.")


@pytest.mark.parametrize("argv, expected", [
    (["--moe-router-topk", "9"], "--moe-router-topk (9) must not exceed --num-experts (8); pick k <= E."),
    (["--moe-router-topk", "0"], "--moe-router-topk must be >= 1, got 0"),
    (["--moe-router-load-balancing-type", "aux_loss"],
     "--moe-router-load-balancing-type aux_loss applies no loss with --moe-aux-loss-coeff 0 (its weight); pass "
     "--moe-aux-loss-coeff C > 0 (e.g. 1e-2), or --moe-router-load-balancing-type none."),
    (["--moe-router-load-balancing-type", "seq_aux_loss"],
     "--moe-router-load-balancing-type seq_aux_loss applies no loss with --moe-aux-loss-coeff 0"),
    (["--moe-router-force-balance", "--moe-router-enable-expert-bias"],
     "--moe-router-enable-expert-bias does nothing with --moe-router-force-balance (the round-robin router never "
     "reads the bias); drop one of them."),
    (["--moe-router-force-balance", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1"],
     "--moe-router-num-groups/--moe-router-group-topk (group-limited routing) do nothing with "
     "--moe-router-force-balance (the round-robin router never reads the groups); drop one of them."),
    (["--moe-expert-capacity-factor", "0"], "--moe-expert-capacity-factor must be > 0, got 0.0"),
    (["--moe-expert-capacity-factor", "-1"], "--moe-expert-capacity-factor must be > 0, got -1.0"),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     "--moe-router-num-groups (3) must divide --num-experts (8); pick a divisor of E."),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "5"],
     "--moe-router-group-topk (5) must not exceed --moe-router-num-groups (4)"),
    (["--moe-router-num-groups", "4"], "--moe-router-num-groups and --moe-router-group-topk go together"),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "1", "--moe-router-topk", "3"],
     "--moe-router-topk (3) exceeds the 2 experts of the --moe-router-group-topk 1 groups kept"),
    (["--moe-router-score-function", "sigmoid", "--moe-router-pre-softmax"],
     "--moe-router-pre-softmax only applies with --moe-router-score-function softmax; drop one of them."),
    (["--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0.01"],
     "--moe-aux-loss-coeff 0.01 needs a balancing loss; pass --moe-router-load-balancing-type aux_loss"),
    (["--moe-token-drop-policy", "position"], "--moe-token-drop-policy position only applies with "
                                              "--moe-expert-capacity-factor F"),
    (["--moe-pad-expert-input-to-capacity"], "--moe-pad-expert-input-to-capacity only applies with "
                                             "--moe-expert-capacity-factor F"),
    (["--moe-router-bias-update-rate", "0.01"], "--moe-router-bias-update-rate 0.01 only applies with "
                                                "--moe-router-enable-expert-bias"),
    (["--moe-layer-freq", "[0,1,1]"], "--moe-layer-freq has 3 entries but --num-layers is 4; give one 0/1 per layer."),
    (["--moe-layer-freq", "0"], "--moe-layer-freq '0' must be an integer N >= 1 or a 0/1 pattern"),
    (["--moe-layer-freq", "([1]*3+[0]*2)"], "--moe-layer-freq has 5 entries but --num-layers is 4"),
    (["--moe-layer-freq", "([2]*3+[0])"], "--moe-layer-freq '([2]*3+[0])' must be an integer N >= 1 or a list of 0"),
    (["--moe-layer-freq", "__import__('os')*4"], "--moe-layer-freq \"__import__('os')*4\" must be an integer N"),
    (["--moe-layer-freq", "[0,2,1,1]"], "--moe-layer-freq '[0,2,1,1]' must be an integer N >= 1 or a list of 0 and 1"),
    (["--moe-router-score-function", "tanh"], "argparse"),
])
def test_a_bad_moe_setting_is_refused_in_one_line(argv, expected, capsys):
    if expected == "argparse":  # a choice argparse refuses itself, with exit 2 and its one line
        with pytest.raises(SystemExit):
            parse_config(MOE + argv)
        assert "--moe-router-score-function: invalid choice: 'tanh'" in capsys.readouterr().err
        return
    message = _refusal(MOE + argv)
    assert message.startswith(expected), message


def test_a_balancing_type_with_its_weight_or_from_a_preset_is_accepted():
    """Only a type given without a weight is refused: the preset's 1e-2 (or one on the command line) applies it."""
    for argv in (["--config", "configs/moe-tiny.yaml", "--moe-router-load-balancing-type", "seq_aux_loss"],
                 MOE + ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"], MOE,
                 # a run's own config.yaml names both, the weight 0 included: --config of it must load
                 MOE + ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0"]):
        RunPlan.resolve(parse_config(argv)[0], 1)


def test_top1_renormalised_routing_parses_and_only_training_is_refused():
    """Top-1 with the softmax over the k chosen (a valid HF Mixtral/Qwen3-MoE) builds, plans and evaluates; a run
    that would train it is refused in one line saying why (the weight is constant 1) and what trains instead."""
    top1 = MOE + ["--moe-router-topk", "1"]
    RunPlan.resolve(parse_config(top1)[0], 1)
    validate(parse_config(top1 + ["--load", "ckpt", "--skip-train"])[0], 1)
    with pytest.raises(ConfigError) as err:
        validate(parse_config(top1)[0], 1)
    message = str(err.value)
    assert "\n" not in message and message.startswith("--moe-router-topk 1 with a softmax over the k chosen"), message
    assert "the constant 1, so the router gets no gradient and cannot train" in message, message
    assert "--skip-train" in message and "--moe-router-pre-softmax" in message, message
    for fix in (["--moe-router-pre-softmax"], ["--moe-router-score-function", "sigmoid"]):
        validate(parse_config(top1 + fix)[0], 1)


@pytest.mark.parametrize("argv, world, expected", [
    (["--ep", "3"], 3, "--num-experts (8) must be divisible by --expert-model-parallel-size/--ep (3); pick an --ep "
                       "that divides E."),
    (["--ep", "4", "--tp", "2", "--sequence-parallel"], 4,
     "the expert grid --etp 2 x --ep 4 x --pp 1 = 8 does not divide the world of 4 ranks (etp x ep must divide the 4 "
     "ranks of a pipeline stage); pick --ep/--etp whose product divides 4, or launch a multiple of 8 processes."),
    (["--ep", "4", "--etp", "1", "--pp", "2"], 4, "the expert grid --etp 1 x --ep 4 x --pp 2 = 8 does not divide"),
    (["--ep", "2", "--tp", "2"], 4, "--num-experts with --tp 2 needs --sequence-parallel (the MoE layer routes "
                                    "sequence-sharded tokens, as in Megatron); add it."),
    (["--etp", "2", "--ffn-hidden-size", "63"], 2, "--moe-ffn-hidden-size (63) must be divisible by --etp (2)"),
    (["--tp", "2", "--sequence-parallel", "--moe-shared-expert-intermediate-size", "33"], 2,
     "--moe-shared-expert-intermediate-size (33) must be divisible by --tp (2)"),
    (["--ep", "2", "--moe-expert-capacity-factor", "1", "--moe-pad-expert-input-to-capacity",
      "--moe-token-dispatcher-type", "allgather"], 2,
     "--moe-pad-expert-input-to-capacity needs --moe-token-dispatcher-type alltoall (the all-gather dispatcher's "
     "exchanges have a fixed size already); drop one of them."),
])
def test_a_layout_the_experts_cannot_take_is_refused_by_the_run_plan(argv, world, expected):
    assert _refusal(MOE + argv, world).startswith(expected)


def test_ep_without_experts_is_refused_for_a_python_caller_too():
    cfg = Config().updated(expert_model_parallel_size=2)  # updated() skips the flag check; the run plan does not
    with pytest.raises(ConfigError, match=r"^--ep 2 needs a mixture-of-experts model; pass --num-experts E or "
                                          r"drop --ep\.$"):
        RunPlan.resolve(cfg, 2)


def test_folded_layouts_resolve_with_their_expert_grid():
    plan = RunPlan.resolve(parse_config(MOE + ["--tp", "2", "--sequence-parallel", "--pp", "2", "--ep", "4",
                                               "--etp", "1"])[0], 8)
    assert (plan.ep, plan.etp, plan.layout.expert.edp, plan.dp) == (4, 1, 1, 2)
    plan = RunPlan.resolve(parse_config(MOE + ["--ep", "2", "--micro-batch-size", "2"])[0], 8)  # etp = tp
    assert (plan.ep, plan.etp, plan.layout.expert.edp) == (2, 1, 4)


@pytest.mark.parametrize("yaml_value, flags, pattern", [
    ("2", [], (True, False, True, False)),
    ("[0, 1, 1, 1]", [], (False, True, True, True)),
    ("'[0,1,1,1]'", [], (False, True, True, True)),
    (None, ["--moe-layer-freq", "0", "1", "0", "1"], (False, True, False, True)),
    (None, [], (True, True, True, True)),
    ("'([0]*1+[1]*3)'", [], (False, True, True, True)),  # Megatron's expression form, read without eval
    (None, ["--moe-layer-freq", "[0]*1+[1]*3"], (False, True, True, True)),
    (None, ["--moe-layer-freq", "([0,1]*2)"], (False, True, False, True)),
])
def test_moe_layer_freq_reads_megatrons_spellings(tmp_path, yaml_value, flags, pattern):
    preset = tmp_path / "moe.yaml"
    preset.write_text("num_experts: 4\nnum_layers: 4\n" + (f"moe_layer_freq: {yaml_value}\n" if yaml_value else ""))
    model = parse_config(["--config", str(preset), *flags])[0].model
    assert tuple(model.is_moe_layer(i) for i in range(4)) == pattern


def test_a_dense_model_has_no_moe_layer_and_the_expert_width_defaults_to_the_mlp():
    assert not any(ModelConfig().is_moe_layer(i) for i in range(4))
    assert ModelConfig(num_experts=4).moe_ffn_size == ModelConfig().ffn_size == 1024
    assert ModelConfig(num_experts=4, moe_ffn_hidden_size=96).moe_ffn_size == 96


def test_checkpoints_record_the_moe_model_and_old_ones_still_load():
    moe = parse_config(MOE + ["--moe-router-topk", "4"])[0]
    old_meta = {"config": {k: v for k, v in Config().to_flat().items()
                           if k not in {f.name for f in fields(MoEFields)}}}  # saved before MoE existed
    merged, changed = merge_config(old_meta, parse_config([])[0])
    assert merged.model.num_experts is None and not [c for c in changed if "moe" in c or "expert" in c]
    merged, changed = merge_config({"config": moe.to_flat()}, parse_config([])[0])  # the checkpoint's experts
    assert (merged.model.num_experts, merged.model.moe_router_topk) == (8, 4) and "--num-experts 8" in changed
    with pytest.raises(ConfigError, match=r"^--num-experts 4 contradicts the checkpoint's 8; "):
        merge_config({"config": moe.to_flat()}, parse_config(["--num-experts", "4"])[0])


def test_help_lists_the_moe_flags_in_their_own_group_after_the_model():
    text = build_parser().format_help()  # each flag's own entry starts a line
    assert text.index("\n  --arch") < text.index("\nmixture of experts (model):") < text.index("\n  --num-experts") \
        < text.index("\n  --lr ")
