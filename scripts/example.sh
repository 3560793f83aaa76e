#!/usr/bin/env bash
# The main job: a small MoE layer through epjit's dispatch and combine, checked against a single-device layer.
# On a machine with NVIDIA GPUs it runs one rank per GPU; without GPUs it says so and runs the NumPy reference
# backend on simulated ranks. Extra arguments go to examples/moe_layer.py.
source "$(dirname "$0")/env.sh"
gpus=$(python -c "from cuda.bindings import runtime as r; e, n = r.cudaGetDeviceCount(); print(n if e == 0 else 0)" 2>/dev/null || echo 0)
if [ "${gpus:-0}" -ge 1 ]; then
  exec python -m epjit.launch -n "$gpus" examples/moe_layer.py "$@"
fi
exec python examples/moe_layer.py "$@"
