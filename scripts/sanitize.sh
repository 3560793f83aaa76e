#!/usr/bin/env bash
# compute-sanitizer over small cases of every kernel family, on one GPU:
#   bash scripts/sanitize.sh [tool ...]              (default: memcheck racecheck synccheck initcheck)
#   SANITIZE_CASES="normal" bash scripts/sanitize.sh memcheck racecheck    (some cases only; the GPU tier's run)
# Cases, one rank (a rank dispatches to and combines from itself: every kernel runs, with no peer process whose
# kernels the sanitizer would have to run beside this one's; SANITIZE_RANKS=2 runs them on 2 ranks through
# epjit.launch, which needs the GPUs to run both ranks' instrumented kernels at once):
#   normal       scripts/soak_buffers.py, two normal-mode cycles: the layout kernel, intranode notify, dispatch and
#                combine, in bf16 and in FP8 (NVLink buffers only: no NVSHMEM)
#   low-latency  two low-latency cycles: dispatch and combine in bf16 and FP8 (NVLink stores into the symmetric
#                region, CUDA IPC memory in one node: no NVSHMEM)
#   ll-puts      the low-latency cycles again through their put path (EPJIT_LL_FORCE_PUTS=1), its puts as NVLink
#                stores (EPJIT_RDMA_BY_STORES=1: the kernels' build without NVSHMEM)
#   peer-memory  tests/ranks/peer_memory.py: the NVLink barrier and exchange, NVSHMEM put + signal
#   internode    two internode cycles (soak_buffers.py --kinds internode) on 2 ranks as 2 NVLink nodes of 1: the
#                internode notify, dispatch and combine, with the RDMA leg as NVLink stores through CUDA IPC memory
#                (EPJIT_RDMA_BY_STORES=1: the kernels' build without NVSHMEM; always 2 ranks: one rank is no pair
#                of nodes)
#   internode-2x2  the same on 4 ranks as 2 nodes of 2 (the NVLink forwarding rings between a node's ranks too)
# The case on NVSHMEM's heap (peer-memory) starts NVSHMEM, whose initialisation under compute-sanitizer
# ran for minutes without finishing on H100 and H200 (NVSHMEM 3.8): SANITIZE_CASE_TIMEOUT (seconds, default 900)
# bounds each case, and a case cut short prints "timeout" in the errors column. A case of more ranks than GPUs runs
# with the ranks sharing them (EPJIT_SHARE_GPUS), where instrumented kernels that wait on each other may not end.
# Prints a line per tool and case: the errors compute-sanitizer reported in kernels (summed over the ranks; CUDA
# API calls that fail on purpose, such as cuda-python probing for driver entry points, are not reported) and the
# exit code; logs under $OUT, where the soak's --progress lines show how far an instrumented run got. Exits 1 when a
# case reported errors, failed or ran out of time. Instrumented spin-waits are slow, so EPJIT_TIMEOUT_S defaults
# to 300 here. Needs compute-sanitizer (CUDA toolkit) on PATH. SANITIZE_FLAGS adds flags to every compute-sanitizer
# command, SANITIZE_TAG names a run's logs apart (runs side by side), SANITIZE_STACK_DUMP_S=N writes every rank's
# Python stacks into the log every N seconds (scripts/with_stack_dumps.py: where a case that runs out of time is).
set -uo pipefail
OUT=${OUT:-/tmp/epjit-out}
mkdir -p "$OUT"
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck synccheck initcheck)
export EPJIT_TIMEOUT_S=${EPJIT_TIMEOUT_S:-300} PYTHONUNBUFFERED=1
ranks=${SANITIZE_RANKS:-1}
runner() {  # the command that starts a case's ranks (this many)
  local dumps=""
  [ -n "${SANITIZE_STACK_DUMP_S:-}" ] && dumps=scripts/with_stack_dumps.py
  if [ "$1" -gt 1 ]; then
    echo python3 -m epjit.launch -n "$1" $dumps
  else
    echo python3 $dumps
  fi
}
[ -n "${SANITIZE_STACK_DUMP_S:-}" ] && export STACK_DUMP_S=$SANITIZE_STACK_DUMP_S
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)  # the ones this run may use: CUDA_VISIBLE_DEVICES narrows them
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && gpus=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
declare -A CASES=(
  [normal]="scripts/soak_buffers.py --kinds normal --cycles 2 --warmup 0 --progress"
  [low-latency]="scripts/soak_buffers.py --kinds low_latency --cycles 2 --warmup 0 --progress"
  [ll-puts]="scripts/soak_buffers.py --kinds low_latency --cycles 2 --warmup 0 --progress"
  [peer-memory]="tests/ranks/peer_memory.py --rounds 2"
  [internode]="scripts/soak_buffers.py --kinds internode --num-nvl-ranks 1 --cycles 2 --warmup 0 --progress"
  [internode-2x2]="scripts/soak_buffers.py --kinds internode --num-nvl-ranks 2 --cycles 2 --warmup 0 --progress"
)
declare -A CASE_RANKS=([internode]=2 [internode-2x2]=4)
names=${SANITIZE_CASES:-normal low-latency ll-puts internode internode-2x2 peer-memory}
limit=${SANITIZE_CASE_TIMEOUT:-900}
# Compile every module first, outside the sanitizer: what it checks is the kernels, not NVRTC.
python3 -m epjit.jit --check > "$OUT/sanitize-jit${SANITIZE_TAG:+-$SANITIZE_TAG}.log" 2>&1 || { echo "jit --check failed"; exit 1; }
failed=0
printf "%-11s %-12s %7s %5s %7s\n" tool case errors rc seconds
for tool in "${tools[@]}"; do
  for name in $names; do
    log="$OUT/sanitize-$tool-$name${SANITIZE_TAG:+-$SANITIZE_TAG}.log"
    settings=()
    [ "$name" = ll-puts ] && settings=(EPJIT_LL_FORCE_PUTS=1 EPJIT_RDMA_BY_STORES=1)
    [[ "$name" = internode* ]] && settings=(EPJIT_RDMA_BY_STORES=1)
    case_ranks=${CASE_RANKS[$name]:-$ranks}
    [ "$gpus" -ge "$case_ranks" ] || settings+=(EPJIT_SHARE_GPUS=1)
    start=$(date +%s)
    # shellcheck disable=SC2086  # the case's arguments split on purpose
    timeout "$limit" env "${settings[@]}" compute-sanitizer --tool "$tool" --target-processes all --print-limit 20 \
      --report-api-errors no ${SANITIZE_FLAGS:-} $(runner "$case_ranks") ${CASES[$name]} > "$log" 2>&1
    rc=$?
    errors=$(grep -ho "ERROR SUMMARY: [0-9]*" "$log" | awk '{s += $3} END {print s + 0}')
    [ "$rc" -eq 124 ] && errors=timeout
    printf "%-11s %-12s %7s %5s %7s\n" "$tool" "$name" "$errors" "$rc" "$(( $(date +%s) - start ))"
    [ "$errors" = 0 ] && [ "$rc" -eq 0 ] || failed=1
  done
done
exit $failed
