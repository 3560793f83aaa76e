#!/usr/bin/env bash
# Every benchmark docs/performance.md reports (normal mode and low latency, the copy ceilings, a profile), in one
# call on a machine with GPUs (the protocol and the columns: docs/benchmark.md):
#   bash scripts/gpu_bench.sh
# python3 must import epjit, its GPU stack and PyTorch (docs/testing.md, "Scripts").
# One rank per GPU (EPJIT_BENCH_RANKS to choose). JSON and logs go under $OUT; a table of every row comes last.
set -uo pipefail
OUT=${OUT:-/tmp/epjit-out}
mkdir -p "$OUT"
export EPJIT_CACHE_DIR=${EPJIT_CACHE_DIR:-/tmp/epjit-cache-$$}
n=${EPJIT_BENCH_RANKS:-$(nvidia-smi -L | wc -l)}
python3 -m epjit.jit --check > "$OUT/jit.log" 2>&1 || { tail -20 "$OUT/jit.log"; exit 1; }
status=0
bench() {  # name, then bench arguments
  local name=$1
  shift
  python3 -m epjit.launch -n "$n" -m epjit.bench --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($OUT/$name.log)"
  [ $rc -eq 0 ] || { status=1; tail -20 "$OUT/$name.log"; }
}
bench ceiling --modes ceiling --no-nccl --ceiling-sms 8 16 24 32
bench normal --tokens 128 4096 8192 --modes dispatch dispatch-fp8 combine
bench normal-sms --tokens 4096 --sms 8 16 32 128 --modes dispatch combine  # 128: every SM a Config takes ("all")
bench low-latency --modes ll-dispatch ll-combine ll-hook --ll-tokens 1 32 128 256
bench profile --tokens 4096 --modes dispatch combine --no-nccl --profile
grep -h "profile\|buffer:\|floor\|host time" "$OUT"/*.log | cut -c1-600
echo "=== $n ranks"
python3 -m epjit.bench --summary $(ls "$OUT"/{ceiling,normal,normal-sms,low-latency}.json 2>/dev/null)
# The device tool brings back only a few files: one archive of them all.
(cd "$OUT" && tar czf bench-logs.tgz --remove-files *.log *.json *.txt 2>/dev/null)
exit $status
