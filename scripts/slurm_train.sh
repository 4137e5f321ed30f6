#!/bin/bash
# Multi-node ndtrain training under Slurm: one torchrun per node, c10d rendezvous on the first node.
#
#   sbatch --nodes 4 --gpus-per-node 8 scripts/slurm_train.sh --config llama3_70b --run-dir /shared/runs/x
#
# Every argument is passed to `ndtrain train`. The run directory must be on a filesystem every node
# sees (checkpoints are written by all ranks and read back on resume); re-submitting the same job
# resumes from its newest complete checkpoint. Override with environment variables:
#   NDTRAIN_PYTHON   python of the environment with ndtrain (default: python3 on PATH)
#   RDZV_PORT        rendezvous port on the first node (default 29500)
#   OMP_NUM_THREADS  threads per rank (default: CPUs per task / GPUs per node, at least 1)
#SBATCH --job-name=ndtrain
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output=slurm-%j.out
set -euo pipefail

PYTHON=${NDTRAIN_PYTHON:-python3}
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE##*:}  # "h100:8" -> "8"
NNODES=${SLURM_NNODES:-1}
HEAD_NODE=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)
RDZV_PORT=${RDZV_PORT:-29500}
CPUS=${SLURM_CPUS_ON_NODE:-$(nproc)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CPUS / GPUS_PER_NODE > 0 ? CPUS / GPUS_PER_NODE : 1 ))}

echo "ndtrain: ${NNODES} nodes x ${GPUS_PER_NODE} ranks, rendezvous ${HEAD_NODE}:${RDZV_PORT}, OMP_NUM_THREADS=${OMP_NUM_THREADS}"
# srun starts one task per node; each runs torchrun, which starts that node's ranks.
srun --kill-on-bad-exit=1 "${PYTHON}" -m torch.distributed.run \
    --nnodes "${NNODES}" --nproc-per-node "${GPUS_PER_NODE}" \
    --rdzv-backend c10d --rdzv-endpoint "${HEAD_NODE}:${RDZV_PORT}" --rdzv-id "${SLURM_JOB_ID}" \
    -m ndtrain.cli.commands train "$@"
