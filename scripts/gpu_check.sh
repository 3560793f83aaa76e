#!/usr/bin/env bash
# Everything the GPU tier checks, in one call on a machine with GPUs (docs/testing.md):
#   bash scripts/gpu_check.sh [pytest -k expression]
# python3 must import epjit, its GPU stack and PyTorch (docs/testing.md, "Scripts").
# Compiles every module cold (fresh cache) and warm, runs the GPU tests, writes logs under $OUT, prints a table.
# GPU_CHECK_WORKERS=N runs the tests in N pytest-xdist workers at once (their ranks share the GPUs), then the leak
# tests alone: they read the GPU's free memory, which other jobs on the same GPUs move.
# On 2 x H200 (2026-11-27) the tier ran in two halves of 5-6 minutes each with 3 workers, beside routing soaks.
set -uo pipefail
OUT=${OUT:-/tmp/epjit-out}
mkdir -p "$OUT"
export EPJIT_CACHE_DIR=${EPJIT_CACHE_DIR:-/tmp/epjit-cache-$$}
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
t0=$(date +%s.%N)
python3 -m epjit.jit --check > "$OUT/jit-cold.log" 2>&1; cold_rc=$?
t1=$(date +%s.%N)
python3 -m epjit.jit --check > "$OUT/jit-warm.log" 2>&1; warm_rc=$?
t2=$(date +%s.%N)
sel=${1:-}
if [ -n "${GPU_CHECK_WORKERS:-}" ]; then
  python3 -m pytest -m gpu -q -rA --timeout 900 -n "$GPU_CHECK_WORKERS" tests -k "not leak${sel:+ and ($sel)}" \
    > "$OUT/gpu-tests.log" 2>&1; tests_rc=$?
  python3 -m pytest -m gpu -q -s -rA --timeout 900 tests -k "leak${sel:+ and ($sel)}" >> "$OUT/gpu-tests.log" 2>&1 \
    || tests_rc=1
else
  python3 -m pytest -m gpu -q -s -rA --timeout 900 tests ${sel:+-k "$sel"} > "$OUT/gpu-tests.log" 2>&1; tests_rc=$?
fi
echo "=== tail of gpu-tests.log"; tail -c 6000 "$OUT/gpu-tests.log"
echo "=== RESULT lines"; grep -h "RESULT\|{'rank'" "$OUT/gpu-tests.log" | cut -c1-400 | head -40
echo "=== summary"
printf "%-28s %s\n" "jit --check cold (s)" "$(python3 -c "print(round($t1 - $t0, 2))") rc=$cold_rc" \
  "jit --check warm (s)" "$(python3 -c "print(round($t2 - $t1, 2))") rc=$warm_rc" \
  "gpu tests" "rc=$tests_rc $(tail -n 1 "$OUT/gpu-tests.log")"
tail -n 2 "$OUT/jit-warm.log"
# The device tool brings back only a few files: one archive of them all.
(cd "$OUT" && tar czf check-logs.tgz --remove-files *.log *.txt 2>/dev/null)
exit $tests_rc
