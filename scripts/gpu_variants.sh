#!/usr/bin/env bash
# The normal-mode warp-role variants against the defaults, alternating on one machine (docs/benchmark.md): the
# 4-rank A/B that decides them (the defaults' 4-rank splits are formulas, never measured on 4 GPUs).
#   bash scripts/gpu_variants.sh [rounds] [bench arguments...]
# (default: 2 rounds, --tokens 4096, dispatch / FP8 dispatch / combine). Four processes a round, ~40 s each on
# 4 x H200. One table a variant comes last; the working tree's defaults are "new".
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
shift || true
[ $# -gt 0 ] || set -- --tokens 4096
rm -rf .ab
side() { bash scripts/gpu_ab.sh variant "$1" -- --warp-roles "$2" >/dev/null; }
side phased dispatch_phased=1              # one sending group serves the peers in turn (the `rotate` pattern)
side combine3 combine_send_warps=3         # combine: 3 sending warps a peer (the formula gives 4 on 4 ranks)
side combine5 combine_send_warps=5
exec bash scripts/gpu_ab.sh run "$rounds" "$@"
