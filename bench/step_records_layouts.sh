#!/usr/bin/env bash
# Step records of issue 41's refactor-proof layouts, for tools/compare_step_records.py (docs/architecture.md).
#   bench/step_records_layouts.sh TREE OUT     (TREE: a checkout, e.g. a `git worktree add` of a commit; OUT: a folder)
# Runs with this checkout's .venv but TREE's code (PYTHONPATH), 4 iterations each on CPU gloo:
# serial, tp 2 x pp 2 x dp 2 ZeRO 1 (8 ranks), ZeRO 3 with the optimizer (and the parameters) offloaded, cp 2, ep 2 MoE.
# Then: .venv/bin/python tools/compare_step_records.py OUT_BEFORE/<layout> OUT_AFTER/<layout>
set -u
TREE=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd); HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python; TORCHRUN=$HERE/.venv/bin/torchrun
cd "$TREE" || exit 1
export PYTHONPATH=$TREE OMP_NUM_THREADS=1
SHAPE="--seq-length 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 4 --log-interval 1 --recompute none"
DENSE="--config configs/tiny.yaml --num-layers 4 --hidden-size 64 --num-attention-heads 4 $SHAPE"
MOE="--config configs/moe-tiny.yaml --num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2
     --num-experts 4 --moe-ffn-hidden-size 64 $SHAPE"
layout() {  # name ranks flags...
  local name=$1 ranks=$2; shift 2
  rm -rf "${OUT:?}/$name"; mkdir -p "$OUT/$name"
  if [ "$ranks" = 1 ]; then launcher=("$PY"); else launcher=("$TORCHRUN" --standalone --nproc-per-node "$ranks"); fi
  MEGAZERO_RECORD_STEPS=$OUT/$name "${launcher[@]}" pretrain_gpt.py "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $?, $(cat "$OUT/$name"/*.jsonl | wc -l) records"
}
layout serial 1 $DENSE
layout tp2pp2dp2_zero1 8 $DENSE --tp 2 --pp 2 --zero 1
layout zero3_offload_optimizer 2 $DENSE --zero 3 --offload-optimizer cpu
layout zero3_offload_params 2 $DENSE --zero 3 --offload-optimizer cpu --offload-params cpu
layout cp2 2 $DENSE --cp 2
layout ep2_moe 2 $MOE --ep 2
