#!/usr/bin/env bash
# Several hosts under mpirun (Open MPI or MPICH): RANKS_PER_NODE ranks on every host of HOSTFILE, one rank per GPU,
# consecutive ranks on one host, so that each host is one NVLink node (epjit.init()'s default num_nvl_ranks) and
# epjit.init() binds each rank to the GPU of its local rank. Keeps NVLink multicast off and passes epjit's settings
# on to every rank, as launch/mpirun.sh does. What NVSHMEM needs on a cluster: docs/running.md, "Across nodes".
#
#   launch/mpirun_multinode.sh HOSTFILE RANKS_PER_NODE script.py [args...]
#       HOSTFILE: one host a line, "host slots=8" (Open MPI) or "host:8" (MPICH); '#' starts a comment.
#       The job has RANKS_PER_NODE x (hosts in HOSTFILE) ranks; the script and PYTHON must exist on every host.
#   MPIRUN_ARGS="-x LD_LIBRARY_PATH" launch/mpirun_multinode.sh hosts 8 ...   extra mpirun arguments
#   PYTHON=/path/to/venv/bin/python launch/mpirun_multinode.sh hosts 8 ...   the interpreter (default python3)
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 HOSTFILE RANKS_PER_NODE script.py [args...]" >&2
  exit 2
fi
hostfile=$1
per_node=$2
shift 2
if [ ! -r "$hostfile" ]; then
  echo "$0: cannot read the hostfile $hostfile" >&2
  exit 2
fi
case $per_node in
  '' | *[!0-9]* | 0*) echo "$0: RANKS_PER_NODE must be a positive integer, got '$per_node'" >&2; exit 2 ;;
esac
# Hosts: the first word of each line without its ":N" (MPICH), comments and blank lines skipped.
nodes=$(sed -e 's/#.*//' "$hostfile" | awk 'NF { sub(/:.*/, "", $1); print $1 }' | sort -u | wc -l)
if [ "$nodes" -eq 0 ]; then
  echo "$0: no hosts in $hostfile" >&2
  exit 2
fi
n=$((nodes * per_node))

export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1} NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} PYTHONUNBUFFERED=1
# NVSHMEM's network settings; NVSHMEM chooses by itself where they are unset. Uncomment, or export before running:
# export NVSHMEM_REMOTE_TRANSPORT=ibrc           # InfiniBand through a CPU proxy thread (NVSHMEM's default)
# export NVSHMEM_IB_ENABLE_IBGDA=1               # GPU-initiated RDMA (IBGDA); needs GPUDirect RDMA
# export NVSHMEM_ENABLE_NIC_PE_MAPPING=1 NVSHMEM_HCA_PE_MAPPING=mlx5_0:1:1,mlx5_1:1:1   # NIC of each local rank
# export NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=ib0   # the interface NVSHMEM's start-up connects over
# export NVSHMEM_DEBUG=INFO                      # print what NVSHMEM chose (transport, NIC of each rank)
python=${PYTHON:-python3}
if mpirun --version 2>&1 | grep -q "Open MPI"; then
  args=(--bind-to none --hostfile "$hostfile" --map-by "ppr:$per_node:node")
  [ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)
  # Open MPI passes only what -x names; MPICH's Hydra passes the whole environment.
  for var in $(env | grep -oE '^(EPJIT_|NVSHMEM_|NCCL_|TORCH_|CUDA_|PYTHON)[A-Za-z0-9_]*'); do args+=(-x "$var"); done
else
  args=(-f "$hostfile" -ppn "$per_node")
fi
# shellcheck disable=SC2086
exec mpirun "${args[@]}" ${MPIRUN_ARGS:-} -np "$n" "$python" "$@"
