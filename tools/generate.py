"""Generate text from a megazero checkpoint, saved in any layout, in one process with a key/value cache.

    .venv/bin/python tools/generate.py --load runs/ckpt --prompt "Return the" --max-new-tokens 32
    .venv/bin/python tools/generate.py --load runs/ckpt --prompt "A" --prompt "The" --temperature 0.8 \\
        --top-k 50 --top-p 0.95 --seed 1 --print-ids

The checkpoint's tensors are stored at full size whatever the run's (tp, pp, dp, zero, cp), so the
whole model is rebuilt here at tp 1 from the config the checkpoint records, and prompts are encoded
with the run's tokenizer (the one it records, or the default corpus's). Decoding is greedy unless
--temperature is above 0 (--top-k, --top-p and --seed shape sampling only, so greedy decoding refuses them),
and stops at the end-of-document token or after --max-new-tokens.
Prompts run one after another; each prints its text (prompt and continuation) and, with
--print-ids, one JSON line of its token ids.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megazero.checkpoint.convert import read_full_state  # noqa: E402
from megazero.config import Config  # noqa: E402
from megazero.data import default_corpus  # noqa: E402
from megazero.data.tokenizer import TokenizerLike, load_tokenizer  # noqa: E402
from megazero.model.generation import Sampling, generate  # noqa: E402
from megazero.model.gpt import GPTModel  # noqa: E402
from megazero.model.transformer import TPContext  # noqa: E402

PROG = "generate.py"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), exit code 2 as argparse's own."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="a --save folder (its latest checkpoint) or an iter_* folder")
    parser.add_argument("--prompt", action="append", required=True,
                        help="text to continue; repeat for several prompts (run one after another)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to add to each prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens (needs --temperature > 0); 0 = all")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling mass (needs --temperature > 0); 1 = all tokens")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the sampling generator (reproducible runs; needs --temperature > 0)")
    parser.add_argument("--tokenizer-model", default=None,
                        help="tokenizer to use instead of the one the checkpoint records")
    parser.add_argument("--print-ids", action="store_true", help="also print each prompt's token ids as JSON")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not os.path.isdir(args.load):
        fail(f"--load {args.load!r} does not exist or is not a folder; pass the --save folder of a training run")
    return args


def refuse_idle_sampling_flags(args: argparse.Namespace) -> None:
    """--top-k, --top-p and --seed shape sampling only: with greedy decoding (--temperature 0) they would do nothing."""
    if args.temperature > 0:
        return
    given = [(f"--top-k {args.top_k}", args.top_k != 0), (f"--top-p {args.top_p:g}", args.top_p != 1),
             (f"--seed {args.seed}", args.seed is not None)]
    for shown, idle in given:
        if idle:
            raise ValueError(f"{shown} only applies when sampling; pass --temperature T > 0 to sample, or drop "
                             f"{shown.split()[0]} for greedy decoding (--temperature 0, the default)")


def load_model(folder: str) -> tuple[Config, GPTModel]:
    """The checkpoint's whole model (fp32, eval mode) and its recorded config."""
    cfg, state = read_full_state(folder, tp=1)
    model = GPTModel(cfg.model, TPContext())
    model.load_state_dict({name: t.float() for name, t in state.items()})
    return cfg, model.eval()


def run_tokenizer(cfg: Config, explicit: str | None) -> TokenizerLike:
    """The tokenizer the run trained with: --tokenizer-model, the recorded one, or the default corpus's."""
    path = explicit or cfg.data.tokenizer_model
    kind = None if explicit else cfg.data.tokenizer_type  # None: the kind the file shows
    if path is None and cfg.data.data_path is not None:
        raise ValueError("the checkpoint records --data-path but no tokenizer; pass --tokenizer-model")
    if path is None:  # trained on the default corpus, or converted from HF (another vocabulary)
        path = default_corpus(log=lambda message: print(message, file=sys.stderr)).tokenizer_model
        corpus_vocab = load_tokenizer(path).vocab_size
        if corpus_vocab != cfg.model.vocab_size:
            raise ValueError(f"the checkpoint records no tokenizer and its vocabulary ({cfg.model.vocab_size}) is "
                             f"not the default corpus tokenizer's ({corpus_vocab}); pass --tokenizer-model")
    tokenizer = load_tokenizer(path, kind)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"tokenizer {path!r} has {tokenizer.vocab_size} tokens, more than the model's vocabulary "
                         f"({cfg.model.vocab_size}); pass the --tokenizer-model the model was trained with")
    return tokenizer


def prompt_ids(tokenizer: TokenizerLike, text: str, index: int, max_new_tokens: int, max_positions: int) -> list[int]:
    """``text``'s ids (an empty prompt conditions on end-of-document: where every training document starts)."""
    ids = tokenizer.encode(text) or [tokenizer.eos_id]
    if len(ids) + max_new_tokens > max_positions:
        raise ValueError(f"--prompt {index} has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that is "
                         f"{len(ids) + max_new_tokens} positions, more than the model's {max_positions} "
                         f"(max_position_embeddings); shorten the prompt or lower --max-new-tokens")
    return ids


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        refuse_idle_sampling_flags(args)
        cfg, model = load_model(args.load)
        tokenizer = run_tokenizer(cfg, args.tokenizer_model)
        prompts = [prompt_ids(tokenizer, text, i, args.max_new_tokens, cfg.model.position_table_size)
                   for i, text in enumerate(args.prompt, start=1)]
    except (ValueError, OSError) as err:
        fail(str(err).splitlines()[0])
    generator = torch.Generator()
    if args.seed is None:
        generator.seed()  # a fresh seed each run; --seed makes runs repeat
    else:
        generator.manual_seed(args.seed)
    for i, ids in enumerate(prompts, start=1):
        new_ids = generate(model, ids, args.max_new_tokens, eos_id=tokenizer.eos_id, sampling=sampling,
                           generator=generator)
        if len(prompts) > 1:
            print(f"[prompt {i}/{len(prompts)}]")
        text_ids = [t for t in ids + new_ids if t != tokenizer.eos_id]
        print(tokenizer.decode(text_ids), flush=True)
        if args.print_ids:
            stop = "eod" if new_ids[-1] == tokenizer.eos_id else "max_new_tokens"
            print(json.dumps({"prompt_ids": ids, "new_ids": new_ids, "stop": stop}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
