#!/usr/bin/env bash
# One rank per GPU under mpirun (Open MPI or MPICH), with NVLink multicast kept off and epjit's settings passed
# on to every rank. epjit.init() binds each rank to the GPU of its local rank.
#
#   launch/mpirun.sh NUM_RANKS script.py [args...]          e.g. launch/mpirun.sh 4 examples/moe_layer.py
#   MPIRUN_ARGS="--hostfile hosts" launch/mpirun.sh 16 ...   extra mpirun arguments
# Several hosts, one NVLink node each: launch/mpirun_multinode.sh HOSTFILE RANKS_PER_NODE script.py [args...]
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 NUM_RANKS script.py [args...]" >&2
  exit 2
fi
n=$1
shift
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
if mpirun --version 2>&1 | grep -q "Open MPI"; then
  args=(--bind-to none)
  [ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)
  # Open MPI passes only what -x names; MPICH's Hydra passes the whole environment.
  for var in $(env | grep -oE '^(EPJIT_|NVSHMEM_|NCCL_|TORCH_|CUDA_|PYTHON)[A-Za-z0-9_]*'); do args+=(-x "$var"); done
else
  args=()
fi
# shellcheck disable=SC2086
exec mpirun "${args[@]}" ${MPIRUN_ARGS:-} -np "$n" "$python" "$@"
