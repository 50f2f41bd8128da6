"""Convert checkpoints: megazero (any layout) -> HF transformers, and HF -> megazero at any (tp, pp; ep, etp).

    python tools/convert_checkpoint.py --input runs/ckpt --output hf_model --to hf
    python tools/convert_checkpoint.py --input hf_model --output runs/from_hf --to megazero --tp 2 --pp 2
    python tools/convert_checkpoint.py --input hf_mixtral --output runs/from_hf --to megazero --ep 2

The HF folder holds config.json (with architectures, dtype and the model's own
max_position_embeddings), model.safetensors in --dtype (sharded above --max-shard-size) and
the run's tokenizer: an HF tokenizer.json as it is, or a fast tokenizer that encodes exactly as
its sentencepiece model; GPT2LMHeadModel, LlamaForCausalLM or (llama with --qk-layernorm)
Qwen3ForCausalLM.from_pretrained loads it, and with --num-experts MixtralForCausalLM (or, with
--qk-layernorm, Qwen3MoeForCausalLM); with --multi-latent-attention DeepseekV3ForCausalLM (its MTP layers
kept, FP8 hub weights dequantised on the way in). An export replaces an earlier one in the folder whole
(either layout), and a crash midway leaves it unloadable, never holding the old weights. A
megazero checkpoint made from HF has no optimizer state and holds a copy of the HF folder's tokenizer
(``tokenizer/``, found wherever the folder moves): `pretrain_gpt.py --load DIR --data-path P` continues
pretraining from the weights on token files made with that tokenizer.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.checkpoint.convert import hf_to_checkpoint, read_full_state, save_hf  # noqa: E402
from megazero.dtypes import DTYPES  # noqa: E402


def _tokenizer_for(cfg, explicit: str | None, explicit_type: str | None) -> tuple[str | None, str | None]:
    """(path, type) of the tokenizer to ship: --tokenizer-model, else the run's (a sentencepiece model or an
    HF tokenizer.json; for a checkpoint made from HF, the copy of its folder's); one made from an HF folder
    without a tokenizer (another vocabulary) ships none."""
    from megazero.data.tokenizer import load_tokenizer

    if explicit:
        vocab = load_tokenizer(explicit, explicit_type).vocab_size
        if vocab > cfg.model.vocab_size:
            raise ValueError(f"--tokenizer-model {explicit!r} has {vocab} tokens, more than the model's vocabulary "
                             f"({cfg.model.vocab_size}); pass the tokenizer the model was trained with.")
        return explicit, explicit_type
    if cfg.data.tokenizer_model:
        return cfg.data.tokenizer_model, cfg.data.tokenizer_type
    if cfg.data.data_path is None:  # trained on the default corpus: its tokenizer, if the vocabulary is its own
        from megazero.data import default_corpus

        path = default_corpus(log=lambda *_: None).tokenizer_model
        return (path, "sentencepiece") if load_tokenizer(path).vocab_size == cfg.model.vocab_size else (None, None)
    return None, None


def _to_hf(args: argparse.Namespace) -> None:
    cfg, state = read_full_state(args.input, flag="--input")
    tokenizer, kind = _tokenizer_for(cfg, args.tokenizer_model, args.tokenizer_type)
    removed = save_hf(args.output, cfg.model, state, tokenizer, int(args.max_shard_size * 2**30),
                      tokenizer_type=kind, dtype=DTYPES[args.dtype] if args.dtype else None)
    if removed:  # an earlier export's files the new one does not write (the other layout, a tokenizer)
        print(f"removed the earlier export's {', '.join(removed)} from {args.output}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="megazero --save folder, or a HF model folder")
    parser.add_argument("--output", required=True)
    parser.add_argument("--to", required=True, choices=("hf", "megazero"))
    parser.add_argument("--tp", type=int, default=1, help="target tensor-parallel size (--to megazero)")
    parser.add_argument("--pp", type=int, default=1, help="target pipeline-parallel size (--to megazero)")
    parser.add_argument("--virtual-pipeline-size", type=int, default=1, help="model chunks per pipeline rank")
    parser.add_argument("--ep", type=int, default=1, help="target expert-parallel size (--to megazero; MoE models)")
    parser.add_argument("--etp", type=int, help="target expert-tensor-parallel size (--to megazero; default: --tp)")
    parser.add_argument("--tokenizer-model", help="tokenizer to ship with the HF folder (default: the run's): a "
                        "sentencepiece .model, an HF tokenizer.json or a folder holding one")
    parser.add_argument("--tokenizer-type", choices=("sentencepiece", "hf"),
                        help="kind of --tokenizer-model; default: inferred from the path")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of the HF weights (--to hf); default: the "
                        "dtype the checkpoint holds them in - the run's compute dtype (bf16 with --bf16, fp16 with "
                        "--fp16, else fp32), or the HF model's own for a checkpoint converted from HF")
    parser.add_argument("--max-shard-size", type=float, default=5.0, help="GiB per HF safetensors file")
    args = parser.parse_args(argv)
    try:
        if args.to == "megazero" and args.dtype:
            raise ValueError("--dtype applies to --to hf; a run casts the weights it loads to its own "
                             "--bf16/--fp16 compute dtype, so drop it.")
        if args.tokenizer_type and not args.tokenizer_model:
            raise ValueError("--tokenizer-type is the kind of --tokenizer-model; pass both, or neither to ship "
                             "the run's tokenizer.")
        if args.to == "hf":
            _to_hf(args)
        else:
            hf_to_checkpoint(args.input, args.output, tp=args.tp, pp=args.pp, vp=args.virtual_pipeline_size,
                             ep=args.ep, etp=args.etp)
    except ValueError as err:
        print(f"convert_checkpoint.py: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
