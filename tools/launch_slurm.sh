#!/usr/bin/env bash
# Start pretrain_gpt.py on every node of a Slurm allocation through torchrun.
#
# Run it once per node (srun --ntasks-per-node=1; see examples/slurm/pretrain_gpt.sbatch): each copy
# execs one torchrun agent, the agents meet in one c10d rendezvous and start the workers. What
# torchrun needs comes from Slurm's environment, so the same line serves every node:
#
#   rendezvous endpoint  the first host of $SLURM_JOB_NODELIST (scontrol show hostnames), port --port
#                        (default $MASTER_PORT, else 29500)
#   store host           the node with $SLURM_NODEID 0 (is_host=true): no guessing from hostnames,
#                        which fails where a node's name is not the one it resolves to
#   --nnodes             $SLURM_NNODES
#   --nproc-per-node     --nproc-per-node N, else $SLURM_GPUS_ON_NODE, else $SLURM_NTASKS_PER_NODE
#   --rdzv-id            $SLURM_JOB_ID
#   --max-restarts       --max-restarts R (default 3): after a worker fails, every worker of the job is
#                        restarted; with --load DIR --save DIR they resume from DIR's latest checkpoint
#
# Node ranks come from the c10d rendezvous (torchrun ignores --node-rank with it); each node's workers
# still get consecutive global ranks, so tensor-parallel groups stay inside a node.
#
# usage: tools/launch_slurm.sh [-h] [--nproc-per-node N] [--max-restarts R] [--port P] [--dry-run] [--] ARGS...
#   ARGS go to pretrain_gpt.py unchanged. --dry-run prints the torchrun command line (shell-quoted)
#   instead of running it. $PYTHON picks the interpreter (default python3).
set -euo pipefail

die() { echo "launch_slurm.sh: error: $*" >&2; exit 2; }
need() { [[ -n "${!1:-}" ]] || die "\$$1 is not set; run this under sbatch/srun (or export it)."; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NPROC="" MAX_RESTARTS=3 PORT="${MASTER_PORT:-29500}" DRY_RUN=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nproc-per-node) NPROC="${2:?--nproc-per-node needs a value}"; shift 2 ;;
        --max-restarts) MAX_RESTARTS="${2:?--max-restarts needs a value}"; shift 2 ;;
        --port) PORT="${2:?--port needs a value}"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
        --) shift; break ;;
        *) break ;;  # the first argument that is not ours: it and the rest are pretrain_gpt.py's
    esac
done

for var in SLURM_JOB_NODELIST SLURM_NNODES SLURM_NODEID SLURM_JOB_ID; do need "$var"; done
NPROC="${NPROC:-${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-}}}"
[[ -n "$NPROC" ]] || die "no worker count per node: pass --nproc-per-node N (neither \$SLURM_GPUS_ON_NODE nor \$SLURM_NTASKS_PER_NODE is set)."
# The whole list, then its first line (piping into head -1 can kill scontrol with SIGPIPE on a long list).
HOSTS="$(scontrol show hostnames "$SLURM_JOB_NODELIST")" || die "scontrol show hostnames '$SLURM_JOB_NODELIST' failed; run this on a Slurm node."
HEAD="${HOSTS%%$'\n'*}"
[[ -n "$HEAD" ]] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' named no host; check \$SLURM_JOB_NODELIST."
IS_HOST=false
[[ "$SLURM_NODEID" == 0 ]] && IS_HOST=true

# No environment workaround for restarts: the workers find a store of their attempt's own through
# torchrun's (megazero/parallel/state.py), whether torchrun shares its store with them or not.
CMD=("${PYTHON:-python3}" -m torch.distributed.run
     --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC"
     --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$SLURM_JOB_ID" --rdzv-conf "is_host=$IS_HOST"
     --max-restarts "$MAX_RESTARTS"
     "$ROOT/pretrain_gpt.py" "$@")
if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi
exec "${CMD[@]}"
