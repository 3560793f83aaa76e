#!/usr/bin/env bash
# Same-machine A/B of the benchmark: an earlier revision against the working tree, alternating, because lent
# machines differ by up to 3x in host-bound times and only rows of one run compare.
#   here:        bash scripts/gpu_ab.sh prepare REV        (puts REV's epjit/ and cuda_src/ under .ab/, ignored)
#   GPU machine: source .device/setup.sh && bash scripts/gpu_ab.sh run [rounds] [bench arguments...]
# (carry [".device", ".ab"]). Each round runs REV, then the working tree; JSON and logs under $OUT.
set -uo pipefail
case ${1:-} in
  prepare)
    rev=${2:?usage: gpu_ab.sh prepare REV}
    rm -rf .ab && mkdir -p .ab/base && git archive "$rev" epjit cuda_src | tar -x -C .ab/base
    git rev-parse --short "$rev" > .ab/rev
    echo "A/B base: $(cat .ab/rev) in .ab/base";;
  run)
    shift
    rounds=${1:-2}; shift || true
    OUT=${OUT:-/tmp/epjit-out}
    mkdir -p "$OUT"
    export EPJIT_CACHE_DIR=${EPJIT_CACHE_DIR:-/tmp/epjit-cache-$$}
    n=${EPJIT_BENCH_RANKS:-$(nvidia-smi -L | wc -l)}
    (cd .ab/base && python3 -c "import epjit; print('base imports', epjit.__file__)")
    for round in $(seq "$rounds"); do
      for side in base new; do
        # Each side runs from its own tree: `python -m` puts the working directory first on sys.path, ahead of
        # PYTHONPATH, so the tree a command starts in is the epjit it imports (and launches on every rank).
        dir=$PWD
        [ $side = base ] && dir=$PWD/.ab/base
        (cd "$dir" && python3 -m epjit.launch -n "$n" -m epjit.bench --json "$OUT/ab-$side-$round.json" "$@") \
          > "$OUT/ab-$side-$round.log" 2>&1 || { echo "$side round $round failed"; tail -20 "$OUT/ab-$side-$round.log"; }
      done
    done
    for side in base new; do
      echo "=== $side ($([ $side = base ] && cat .ab/rev || echo 'working tree'))"
      python3 -m epjit.bench --summary "$OUT"/ab-$side-*.json
    done
    (cd "$OUT" && tar czf ab-logs.tgz --remove-files ab-*.log ab-*.json);;
  *) echo "usage: gpu_ab.sh prepare REV | run [rounds] [bench arguments...]"; exit 2;;
esac
