"""Typed run configuration: one dataclass per concern, validated when built.

Every field carries its CLI flag names and help text in its metadata, so the
argument parser (``megazero.arguments``) is generated from these classes and
YAML presets load into the very same fields. Flags use Megatron-LM's long
names; a few have short aliases (``--tp``, ``--pp``). Bad values raise
``ConfigError`` (a ``ValueError``) with one sentence naming the flag and the fix.
Sections are frozen: a change is ``Config.updated(...)``, which validates again.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

# ConfigError and flag are re-exported: callers import every config name from here
from .config_fields import ConfigError, Needs, check_applicable, check_fields, flag, opt, require, when  # noqa: F401
from .model_config import ModelConfig  # noqa: F401 (re-exported: one import for every section)
from .parallel_config import OFFLOAD_FLAGS, ParallelConfig  # noqa: F401 (re-exported, as ModelConfig)


class Placement(str, enum.Enum):
    """Where a kind of training state lives between uses (offload tiers; optimizer state: all three).

    ``flag_word`` is the word ``--offload-optimizer``/``--offload-params`` (and the planner's tables) use:
    none = the device, cpu = host memory (pinned on CUDA), disk = per-rank files under --offload-path.
    """

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"

    @property
    def flag_word(self) -> str:
        return _OFFLOAD_FLAGS[self.value]

    @property
    def offloaded(self) -> bool:
        return self is not Placement.DEVICE

    @classmethod
    def from_flag_word(cls, word: str) -> "Placement":
        return cls({flag_word: value for value, flag_word in _OFFLOAD_FLAGS.items()}[word])


RECOMPUTE_MODES = ("none", "selective", "full")  # the one home of the recompute modes, cheapest compute first
_OFFLOAD_FLAGS = dict(zip(("device", "host", "disk"), OFFLOAD_FLAGS))  # Placement value -> flag word


OPTIMIZERS = ("adamw", "muon")
MUON_LR_ADJUSTMENTS = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn names
MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the NS quintic's (a, b, c): Keller Jordan's, torch's defaults
MUON_NS_DTYPES = ("fp32", "bf16")
_WITH_MUON = Needs("--optimizer muon", ("optimizer",), lambda name: name == "muon")
_WITH_QK_CLIP = Needs("--qk-clip-threshold", ("qk_clip_threshold",), lambda threshold: threshold is not None)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    lr: float = opt(3e-4, "Peak learning rate.", at_least=0)
    min_lr: float = opt(0.0, "Learning rate at the end of decay.", at_least=0)
    lr_warmup_iters: int = opt(0, "Linear warm-up iterations.", at_least=0)
    lr_warmup_fraction: float | None = opt(None, "Warm-up as a fraction of --lr-decay-iters (overrides iters).",
                                           at_least=0, at_most=1)
    lr_decay_iters: int | None = opt(None, "Iterations over which the LR decays; None = --train-iters.", at_least=1)
    lr_decay_style: str = opt("cosine", "LR decay shape.", choices=("constant", "linear", "cosine", "wsd"))
    lr_wsd_decay_fraction: float = opt(0.2, "For wsd: fraction of decay iterations spent in the final decay.",
                                       at_least=0, at_most=1, applies=when("lr_decay_style", "wsd"))
    weight_decay: float = opt(0.01, "Decoupled weight decay of AdamW, and of Muon with --optimizer muon (not applied "
                              "to biases and norm weights).", at_least=0)
    adam_beta1: float = opt(0.9, "AdamW beta1.", at_least=0, below=1)
    adam_beta2: float = opt(0.95, "AdamW beta2.", at_least=0, below=1)
    adam_eps: float = opt(1e-8, "AdamW epsilon.", above=0)
    clip_grad: float = opt(1.0, "Clip the global gradient L2 norm to this; 0 disables clipping.", at_least=0)
    optimizer: str = opt("adamw", "adamw, or muon: Newton-Schulz-orthogonalised momentum for the hidden weight "
                         "matrices, AdamW for the embeddings, output head, norms and biases (docs/optimizers.md).",
                         choices=OPTIMIZERS)
    muon_momentum: float = opt(0.95, "Muon's momentum coefficient mu.", at_least=0, below=1, applies=_WITH_MUON)
    muon_nesterov: bool = opt(True, "Muon orthogonalises the Nesterov direction lerp(grad, momentum, mu); "
                              "--no-muon-nesterov: the momentum itself.", applies=_WITH_MUON)
    muon_ns_steps: int = opt(5, "Newton-Schulz iterations per matrix and step.", at_least=1, at_most=99,
                             applies=_WITH_MUON)
    muon_ns_coefficients: tuple[float, float, float] = opt(
        MUON_NS_COEFFICIENTS, "The (a, b, c) of Muon's Newton-Schulz quintic a X + b (X X^T) X + c (X X^T)^2 X; the "
        "default is Keller Jordan's (torch.optim.Muon's).", applies=_WITH_MUON)
    muon_ns_dtype: str = opt("fp32", "The dtype Newton-Schulz runs in: fp32, or bf16 as torch.optim.Muon runs it.",
                             choices=MUON_NS_DTYPES, applies=_WITH_MUON)
    muon_lr_adjust: str = opt("match_rms_adamw", "Muon's per-matrix lr: match_rms_adamw (Moonlight's, the default: "
                              "--optimizer muon keeps a preset's AdamW --lr and weight decay) lr * 0.2 * sqrt(max(out, "
                              "in)), an update RMS like AdamW's; original (torch.optim.Muon's default) lr * "
                              "sqrt(max(1, out/in)), for a Muon-sized lr (~0.02).",
                              choices=MUON_LR_ADJUSTMENTS, applies=_WITH_MUON)
    muon_adam_lr: float | None = opt(None, "Peak lr of the parameters AdamW trains beside Muon (it follows the "
                                     "--lr schedule, scaled by --muon-adam-lr / --lr); None = --lr.", at_least=0,
                                     applies=_WITH_MUON)
    qk_clip_threshold: float | None = opt(None, "MuonClip (Kimi K2's QK-clip): after each step, every attention "
                                          "head whose largest pre-softmax logit in the step exceeded this tau has "
                                          "its query and key weight rows scaled down so that it would be tau "
                                          "(docs/optimizers.md#muonclip-qk-clip); None = off.", above=0,
                                          applies=_WITH_MUON)
    qk_clip_alpha: float = opt(0.5, "QK-clip's split of the factor gamma = tau / max: queries by gamma^alpha, keys "
                               "by gamma^(1 - alpha).", at_least=0, at_most=1, applies=_WITH_QK_CLIP)

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.min_lr <= self.lr, f"--min-lr ({self.min_lr}) must not exceed --lr ({self.lr}).")
        warmup = (f"--lr-warmup-fraction {self.lr_warmup_fraction} of it" if self.lr_warmup_fraction is not None
                  else f"--lr-warmup-iters ({self.lr_warmup_iters})")
        require(self.lr_decay_style == "constant" or self.lr_decay_iters is None
                or self.warmup_iters(self.lr_decay_iters) < self.lr_decay_iters,
                f"the warm-up ({warmup}) must end before --lr-decay-iters ({self.lr_decay_iters}), or the LR "
                f"jumps from its peak to --min-lr; shorten the warm-up or raise --lr-decay-iters.")
        a_b_c = self.muon_ns_coefficients
        require(len(a_b_c) == 3 and all(map(math.isfinite, a_b_c)) and a_b_c[0] > 0,
                f"--muon-ns-coefficients must be three finite numbers a b c with a > 0 (with a <= 0 a matrix's small "
                f"singular directions would vanish from the update or point uphill), got {' '.join(map(str, a_b_c))}.")
        require(self.muon_adam_lr is None or self.lr > 0,
                "--muon-adam-lr follows the --lr schedule, which --lr 0 keeps at zero; pass --lr > 0 or drop "
                "--muon-adam-lr.")

    def adam_lr(self, lr: float) -> float:
        """The lr of the AdamW-trained parameters at a step whose scheduled lr is ``lr``: with --optimizer muon and
        --muon-adam-lr, that peak lr on the --lr schedule's shape; else ``lr`` itself."""
        if self.optimizer != "muon" or self.muon_adam_lr is None:
            return lr
        return self.muon_adam_lr if lr == self.lr else lr * (self.muon_adam_lr / self.lr)

    def warmup_iters(self, decay_iters: int) -> int:
        """Warm-up iterations: --lr-warmup-fraction of the decay span when given, else --lr-warmup-iters."""
        if self.lr_warmup_fraction is not None:
            return int(self.lr_warmup_fraction * decay_iters)
        return self.lr_warmup_iters


# a compiled block would be re-traced for every micro-batch's document layout
_WITHOUT_COMPILE = Needs("--no-compile", ("compile",), lambda compile: not compile)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    data_path: list[str] | None = opt(None, "Preprocessed prefix(es), optionally weighted: 'W1 P1 W2 P2'; "
                                      "None = the embedded default corpus.")
    tokenizer_model: str | None = opt(None, "Tokenizer: a sentencepiece .model file, an HF tokenizer.json or a folder "
                                      "holding one; None = the default corpus's tokenizer.")
    tokenizer_type: str | None = opt(None, "Tokenizer kind: sentencepiece (a .model file) or hf (a tokenizer.json, "
                                     "or a folder holding one); None = inferred from --tokenizer-model.",
                                     choices=("sentencepiece", "hf"))
    split: str = opt("969,30,1", "Train/valid/test proportions of the documents.")
    data_cache_path: str | None = opt(None, "Folder for the sample-index caches (Megatron's flag), for a read-only "
                                      "data folder; None = an index-cache folder beside each --data-path prefix.")
    reset_position_ids: bool = opt(False, "Packed documents: positions restart at 0 after every end-of-document "
                                   "(EOD) token of a sample (learned table and RoPE; docs/data.md).",
                                   applies=_WITHOUT_COMPILE)
    reset_attention_mask: bool = opt(False, "Packed documents: a token attends only to earlier tokens of its own "
                                     "document (block-diagonal causal attention; docs/data.md).",
                                     applies=_WITHOUT_COMPILE)
    eod_mask_loss: bool = opt(False, "No loss where the input token is the EOD (its prediction of the next "
                              "document's first token); the loss is the mean over the kept tokens of the global "
                              "batch.")
    plan_document_length: int | None = opt(None, "Memory planner, --dry-run and layout search under "
                                           "--reset-attention-mask: plan documents of this many tokens (the real "
                                           "lengths are known only once data is read); None = --seq-length, one "
                                           "document per sample (the upper bound).", at_least=1,
                                           applies=when("reset_attention_mask", True))

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    micro_batch_size: int = opt(4, "Samples per micro-batch per data-parallel rank.", at_least=1)
    global_batch_size: int = opt(16, "Samples per optimizer step over all data-parallel ranks.", at_least=1)
    train_iters: int = opt(100, "Optimizer steps to run.", at_least=1)
    seed: int = opt(1234, "Seed for weights, data order and dropout.", at_least=0)
    deterministic: bool = opt(False, "Deterministic kernels only (slower on GPU): what bitwise resume on CUDA needs.")
    device: str = opt("auto", "cpu, cuda, or auto (cuda when available).", choices=("auto", "cpu", "cuda"))
    bf16: bool = opt(False, "bf16 compute weights with fp32 master weights.")
    fp16: bool = opt(False, "fp16 compute weights with fp32 master weights and dynamic loss scaling.")
    main_grads_dtype: str = opt("fp32", "Dtype of the accumulated main gradients with --bf16/--fp16 "
                                "(bf16 = the ZeRO paper's 2+2+12 bytes/param).", choices=("fp32", "bf16"))
    initial_loss_scale: float = opt(65536.0, "--fp16: starting dynamic loss scale.", above=0,
                                    applies=when("fp16", True))
    min_loss_scale: float = opt(1.0, "--fp16: the loss scale never drops below this.", above=0,
                                applies=when("fp16", True))
    loss_scale_window: int = opt(1000, "--fp16: double the loss scale after this many steps without overflow.",
                                 at_least=1, applies=when("fp16", True))
    max_skipped_steps: int = opt(10, "Stop the run after this many consecutive steps skipped for a non-finite "
                                 "loss or grad norm (fp16 loss-scale halvings above --min-loss-scale "
                                 "do not count); 0 = never stop.", at_least=0)
    eval_interval: int = opt(0, "Evaluate every N iterations; 0 disables.", at_least=0)
    eval_iters: int = opt(2, "Global batches per evaluation (>= 1 when --eval-interval is set).", at_least=0)
    recompute: str = opt("none", "Activation recomputation: none; selective (re-run the attention core in "
                         "backward); full (keep only each block's input, re-run the block); auto (the memory "
                         "planner picks the first of none, selective, full whose predicted peak per rank fits "
                         "90% of the budget: --memory-budget-gb, else the GPU's memory, else this node's "
                         "available memory / ranks on it; docs/memory_planner.md).",
                         choices=(*RECOMPUTE_MODES, "auto"))
    memory_budget_gb: float | None = opt(None, "--recompute auto: memory per rank, in GiB, to fit (overrides what "
                                         "the device reports); None = the device's.", above=0,
                                         at_most=1024 * 1024, applies=when("recompute", "auto"))
    recompute_num_layers: int | None = opt(None, "With --recompute full: recompute only the first N blocks of "
                                           "each model chunk; None = all of them.", at_least=0,
                                           applies=when("recompute", "full", "auto"))
    cross_entropy_chunk_size: int = opt(0, "Compute the output head and the loss fused, this many tokens at a time, "
                                        "so the fp32 logits are never held whole; 0 = the plain head then loss.",
                                        at_least=0)
    compile: bool = opt(False, "torch.compile each transformer block's forward (regional: one compiled graph "
                        "shared by all blocks, module hooks and recompute unchanged; docs/performance.md).")
    compile_backend: str = opt("inductor", "--compile: the torch.compile backend; aot_eager traces the same graphs "
                               "without generating code (tells a tracing problem from a codegen one).",
                               choices=("inductor", "aot_eager", "eager"), applies=when("compile", True))

    def __post_init__(self) -> None:
        check_fields(self)
        require(self.eval_iters >= 1 or not self.eval_interval,
                f"--eval-iters 0 with --eval-interval {self.eval_interval} evaluates no batch; pass --eval-iters "
                f">= 1, or --eval-interval 0 to turn evaluation off.")
        require(not (self.bf16 and self.fp16), "--bf16 and --fp16 are exclusive; pick one.")
        require(self.main_grads_dtype == "fp32" or self.bf16 or self.fp16,
                 "--main-grads-dtype bf16 needs --bf16 or --fp16; drop it for fp32 training.")
        require(self.min_loss_scale <= self.initial_loss_scale,
                f"--min-loss-scale ({self.min_loss_scale}) must not exceed --initial-loss-scale "
                f"({self.initial_loss_scale}).")


_WITH_WANDB = Needs("--wandb-project P", ("wandb_project",), lambda project: project is not None)  # no run without it


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    log_interval: int = opt(10, "Print and record metrics every N iterations.", at_least=1)
    metrics_file: str | None = opt(None, "Append one JSON object per logged iteration to this file.")
    tensorboard_dir: str | None = opt(None, "Also write every numeric field of each logged iteration and evaluation "
                                            "to TensorBoard event files in this folder (from the metrics file's rank).")
    timeline: str | None = opt(None, "Write each rank's forward/backward spans as Chrome-trace JSON to this path "
                               "('{rank}' in it is replaced, else '.rank<N>' is added before the extension).")

    log_timers: bool = opt(False, "Also log how long this rank was blocked in tp/pp/dp communication per step "
                                  "(the log line in ms, the metrics file's comm_wait_s in seconds), and the "
                                  "pipeline bubble fraction.")
    wandb_project: str | None = opt(None, "Log to Weights & Biases under this project (rank 0 of the last stage).")
    wandb_name: str | None = opt(None, "wandb run name.", applies=_WITH_WANDB)
    wandb_mode: str | None = opt(None, "wandb mode; None = online with an API key configured, else offline.",
                                 applies=_WITH_WANDB,
                                 choices=("online", "offline", "disabled"))
    wandb_dir: str | None = opt(None, "Folder for wandb's files; None = ./wandb.", applies=_WITH_WANDB)

    def __post_init__(self) -> None:
        check_fields(self)


_WITH_SAVE = Needs("--save DIR", ("save",), lambda save: save is not None)  # nothing is saved without it
_WITH_LOAD = Needs("--load DIR", ("load",), lambda load: load is not None)  # nothing is loaded without it


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    save: str | None = opt(None, "Folder to write checkpoints to (each iteration in its own iter_* folder).")
    save_interval: int = opt(0, "Save every N iterations (and at the end, and on SIGTERM/SIGINT); 0 = only "
                                "at the end and on a signal.", at_least=0, applies=_WITH_SAVE)
    load: str | None = opt(None, "Resume from this folder (its 'latest' checkpoint) or one iter_* folder; any "
                                 "tp/pp/dp/zero layout loads into any other of the same model. The model, data and "
                                 "tokenizer settings come from the checkpoint unless given.")
    finetune: bool = opt(False, "Load only the model weights from --load (Megatron's flag): a new run from them, with "
                         "a fresh optimizer and LR schedule, iteration 0, the data from its start and every generator "
                         "from --seed; the checkpoint's model, data and tokenizer settings still apply.",
                         applies=_WITH_LOAD)
    load_optim: bool = opt(True, "--no-load-optim: keep the checkpoint's iteration and data position but start the "
                           "optimizer fresh (fp32 master weights from the loaded weights, zero Adam moments and "
                           "Muon momentum, the initial loss scale); the LR schedule follows the iteration.",
                           applies=_WITH_LOAD)
    load_rng: bool = opt(True, "--no-load-rng: do not restore the checkpoint's random generators; they start from "
                         "--seed as in a new run.", applies=_WITH_LOAD)
    skip_train: bool = opt(False, "Evaluate the --load checkpoint on --eval-iters batches of the validation split "
                           "(the batches a run evaluates), print and record the validation loss and perplexity at "
                           "its iteration, and exit: no training, no saving.", applies=_WITH_LOAD)
    keep_last: int | None = opt(None, "Keep only the newest K checkpoints under --save; None keeps all.", at_least=1,
                                applies=_WITH_SAVE)
    async_save: bool = opt(False, "Save in the background: the step only copies this rank's shard to host memory "
                           "(pinned on CUDA); a thread writes the files, and the checkpoint is published once every "
                           "rank's write is done (the next save and the end of training wait for it).",
                           applies=_WITH_SAVE)

    def __post_init__(self) -> None:
        check_fields(self)


def _by_section(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat ``{field: value}`` settings grouped by the config section that owns each field."""
    owners = {f.name: section for section, klass in SECTIONS.items() for f in fields(klass)}
    per_section: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        name = key.replace("-", "_")
        require(name in owners, f"unknown setting {key!r}; see `pretrain_gpt.py --help` for the names.")
        per_section.setdefault(owners[name], {})[name] = value
    return per_section


SECTIONS: dict[str, type] = {
    "parallel": ParallelConfig,
    "model": ModelConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}


MODEL_FIELDS = frozenset(f.name for f in fields(ModelConfig))


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole run, frozen: built by ``from_flat``, changed only by ``updated`` (which re-validates)."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    explicit: frozenset[str] = field(default=frozenset(), compare=False)
    """Settings the user gave (YAML preset or flag), not defaults. Not a flag and not in ``to_flat()``."""
    from_preset: frozenset[str] = field(default=frozenset(), compare=False)
    """The part of ``explicit`` that only a ``--config`` preset gave (no flag typed): on --load, a model setting
    of the checkpoint replaces these rather than being contradicted by them (``typed``)."""

    @property
    def typed(self) -> frozenset[str]:
        """Settings given on the command line: --load refuses a model setting of these that contradicts the
        checkpoint's."""
        return self.explicit - self.from_preset

    @classmethod
    def from_flat(cls, settings: dict[str, Any], explicit: frozenset[str] = frozenset(),
                  model_pending: bool = False, from_preset: frozenset[str] = frozenset()) -> "Config":
        """Route each flat key to its section; an unknown key is an error naming it. A setting given
        (``explicit``, or off its default) that cannot apply to this run is refused; ``updated`` does not
        refuse, since what it changes is the program's derivation (a planner's candidate), not the user's.
        ``model_pending``: a --load checkpoint may still supply the model settings not typed (``--load ckpt
        --ep 2`` needs no --num-experts; a preset's yield to it), so the settings that depend on those wait for
        ``refuse_inapplicable``. ``from_preset``: the given settings that only the preset gave."""
        per_section = _by_section(settings)
        config = cls(**{section: SECTIONS[section](**per_section.get(section, {})) for section in SECTIONS},
                     explicit=explicit, from_preset=from_preset & explicit)
        config.refuse_inapplicable(MODEL_FIELDS - config.typed if model_pending else frozenset())
        return config

    def refuse_inapplicable(self, pending: frozenset[str] = frozenset()) -> None:
        """Refuse a setting given that cannot apply to this run, except those that depend on ``pending`` ones."""
        check_applicable([getattr(self, section) for section in SECTIONS], self.explicit, pending)
        self.model.refuse_idle_balancing(self.explicit, pending)  # a balancing loss given without its weight
        self.refuse_unbuilt_muon()
        self.refuse_unclippable()

    def refuse_unclippable(self) -> None:
        """--qk-clip-threshold needs weights whose scale reaches the logits; one line naming the flag for the runs
        where that fails. (It composes with --compile, --multi-latent-attention and --offload-optimizer:
        ``tests/optimizer/test_qk_clip_*.py``.)"""
        if self.optimizer.qk_clip_threshold is None:
            return
        require(not self.model.qk_layernorm, "--qk-clip-threshold scales the query and key weights, which "
                                             "--qk-layernorm's per-head RMSNorm divides out again (the logits "
                                             "would not change); drop one of the two.")
        require(not self.model.mtp_depth, "--qk-clip-threshold is built for the main model's layers; the "
                                          "--mtp-num-layers blocks would need their own rows (not built yet): drop "
                                          "one of the two.")

    def refuse_unbuilt_muon(self) -> None:
        """--optimizer muon runs exactly at ZeRO 0-3 with every parallelism (data, tensor and sequence, pipeline,
        context, expert) and with its state offloaded to host memory or disk; a feature it is not built for would be
        refused here, one line naming the flag, not run wrong (none is now; the layout search calls this)."""
        if self.optimizer.optimizer != "muon":
            return
        unbuilt: list[tuple[bool, str, str]] = []  # (refused, the setting as given, what to pass instead)
        for refused, setting, instead in unbuilt:
            require(not refused, f"--optimizer muon is not built for {setting} yet (docs/optimizers.md#status); "
                                 f"pass {instead}, or --optimizer adamw.")

    def updated(self, **settings: Any) -> "Config":
        """A copy with these flat settings changed; every changed section validates itself again."""
        return replace(self, **{section: replace(getattr(self, section), **kw)
                                for section, kw in _by_section(settings).items()})

    def to_flat(self) -> dict[str, Any]:
        return {f.name: getattr(getattr(self, s), f.name) for s, k in SECTIONS.items() for f in fields(k)}
