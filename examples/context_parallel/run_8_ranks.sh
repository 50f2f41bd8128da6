#!/usr/bin/env bash
# Issue 24's end-to-end run on one machine: 8 ranks, tp 2 x cp 2 x pp 2 at ZeRO 3, seq 2048, the built-in
# corpus, evaluation every 10 steps. Then the same run resumed from iteration 20 (iterations 21-30 must
# equal the first run's bitwise), then the checkpoint of iteration 30 continued at --cp 4 --pp 1.
#   bash examples/context_parallel/run_8_ranks.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/cp_8_ranks}
rm -rf "$OUT" && mkdir -p "$OUT"
RUN=(.venv/bin/torchrun --standalone --nproc_per_node 8 pretrain_gpt.py --seq-length 2048 --micro-batch-size 1
     --global-batch-size 4 --lr 1e-3 --lr-warmup-iters 5 --log-interval 5 --eval-interval 10 --eval-iters 1)
export OMP_NUM_THREADS=1
"${RUN[@]}" --tp 2 --cp 2 --pp 2 --zero 3 --train-iters 30 --save "$OUT/ckpt" --save-interval 10 \
    --metrics-file "$OUT/first.jsonl"
"${RUN[@]}" --tp 2 --cp 2 --pp 2 --zero 3 --train-iters 30 --load "$OUT/ckpt/iter_0000020" \
    --metrics-file "$OUT/resumed.jsonl"
"${RUN[@]}" --tp 2 --cp 4 --pp 1 --zero 3 --train-iters 40 --load "$OUT/ckpt/iter_0000030" \
    --metrics-file "$OUT/cp4.jsonl"
.venv/bin/python - "$OUT" <<'PY'
import json, sys
def steps(name):
    rows = [json.loads(l) for l in open(f"{sys.argv[1]}/{name}.jsonl")]
    return {r["iteration"]: r for r in rows if "event" not in r and "loss" in r}
first, resumed, cp4 = steps("first"), steps("resumed"), steps("cp4")
same = [i for i in resumed if (resumed[i]["loss"], resumed[i]["grad_norm"]) == (first[i]["loss"], first[i]["grad_norm"])]
print(f"loss: iteration {min(first)} {first[min(first)]['loss']:.3f} -> {max(first)} {first[max(first)]['loss']:.3f}; "
      f"at cp 4: {max(cp4)} {cp4[max(cp4)]['loss']:.3f}")
print(f"resumed iterations {sorted(resumed)}: {len(same)} of {len(resumed)} bitwise equal to the first run")
assert len(same) == len(resumed) and first[max(first)]["loss"] < first[min(first)]["loss"]
PY
