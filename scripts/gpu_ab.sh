#!/usr/bin/env bash
# Same-machine A/B of the benchmark (docs/benchmark.md): earlier revisions or saved variants against the working
# tree, alternating, because machines of one kind differ by up to 3x in host-bound times and only rows of one run
# compare.
#   here:        bash scripts/gpu_ab.sh prepare REV [NAME]   (REV's epjit/ and cuda_src/ under .ab/NAME, ignored;
#                                                             NAME defaults to base and replaces every variant)
#                bash scripts/gpu_ab.sh save NAME            (the working tree's epjit/ and cuda_src/ as a variant)
#                bash scripts/gpu_ab.sh variant NAME [VAR=VALUE...] [-- bench arguments...]  (the working tree
#                                                             run with these settings and/or extra bench arguments,
#                                                             e.g. EPJIT_LL_NUM_SMS=64, or -- --warp-roles
#                                                             dispatch_phased=1)
#   GPU machine: bash scripts/gpu_ab.sh run [rounds] [bench arguments...]
#                bash scripts/gpu_ab.sh host [rounds] [host_path.py arguments...]  (scripts/host_path.py, one rank,
#                                                             for every variant with a tree of its own, then the
#                                                             working tree: host microseconds a call)
# (.ab/ is ignored by git: copy it along when the GPU machine is another one). Each round runs every variant in
# name order, then the working tree; JSON and logs under $OUT, then one table a variant.
set -uo pipefail
mode=${1:-}
# The archive name for a run's logs under $OUT: NAME.tgz, or NAME-2.tgz, ... when an earlier run in the same $OUT
# left one (two A/Bs in one GPU call keep both).
fresh() { local name=$1.tgz i=2; while [ -e "$OUT/$name" ]; do name=$1-$i.tgz; i=$((i + 1)); done; echo "$name"; }
if [ "$mode" = run ] || [ "$mode" = host ]; then  # both take [rounds] then arguments for what they run
  shift
  rounds=${1:-2}; shift || true
  OUT=${OUT:-/tmp/epjit-out}
  mkdir -p "$OUT"
  export EPJIT_CACHE_DIR=${EPJIT_CACHE_DIR:-/tmp/epjit-cache-$$}
fi
case $mode in
  prepare)
    rev=${2:?usage: gpu_ab.sh prepare REV [NAME]}
    name=${3:-base}
    [ "$name" = base ] && rm -rf .ab
    rm -rf ".ab/$name" && mkdir -p ".ab/$name" && git archive "$rev" epjit cuda_src | tar -x -C ".ab/$name"
    echo "$(git rev-parse --short "$rev")" > ".ab/$name/.rev"
    echo "A/B variant $name: $(cat ".ab/$name/.rev")";;
  save)
    name=${2:?usage: gpu_ab.sh save NAME}
    rm -rf ".ab/$name" && mkdir -p ".ab/$name" && cp -r epjit cuda_src ".ab/$name/"
    find ".ab/$name" -name __pycache__ -prune -exec rm -rf {} +
    echo "working tree at $(git rev-parse --short HEAD) + edits" > ".ab/$name/.rev"
    echo "A/B variant $name saved";;
  variant)
    name=${2:?usage: gpu_ab.sh variant NAME [VAR=VALUE...] [-- bench arguments...]}
    shift 2
    rm -rf ".ab/$name" && mkdir -p ".ab/$name"
    : > ".ab/$name/.env"
    while [ $# -gt 0 ] && [ "$1" != -- ]; do printf '%s\n' "$1" >> ".ab/$name/.env"; shift; done
    [ $# -eq 0 ] || shift
    : > ".ab/$name/.args"
    [ $# -eq 0 ] || printf '%s\n' "$@" > ".ab/$name/.args"  # none: an empty file (not one empty argument)
    echo "working tree with $(tr '\n' ' ' < ".ab/$name/.env")$*" > ".ab/$name/.rev"
    echo "A/B variant $name: $(cat ".ab/$name/.rev")";;
  run)
    n=${EPJIT_BENCH_RANKS:-$(nvidia-smi -L | wc -l)}
    sides=$(cd .ab && ls -d */ | tr -d /)
    for round in $(seq "$rounds"); do
      for side in $sides new; do
        # Each side runs from its own tree: `python -m` puts the working directory first on sys.path, ahead of
        # PYTHONPATH, so the tree a command starts in is the epjit it imports (and launches on every rank).
        # A side with a tree of its own runs it; a settings-only side (variant) runs the working tree.
        dir=$PWD settings=() extra=()
        [ $side = new ] || [ ! -d ".ab/$side/epjit" ] || dir=$PWD/.ab/$side
        [ $side = new ] || [ ! -s ".ab/$side/.env" ] || mapfile -t settings < ".ab/$side/.env"
        [ $side = new ] || [ ! -s ".ab/$side/.args" ] || mapfile -t extra < ".ab/$side/.args"
        (cd "$dir" && env "${settings[@]}" python3 -m epjit.launch -n "$n" -m epjit.bench \
           --json "$OUT/ab-$side-$round.json" "$@" "${extra[@]}") \
          > "$OUT/ab-$side-$round.log" 2>&1 || { echo "$side round $round failed"; tail -20 "$OUT/ab-$side-$round.log"; }
      done
    done
    for side in $sides new; do
      echo "=== $side ($([ $side = new ] && echo 'working tree' || cat ".ab/$side/.rev"))"
      python3 -m epjit.bench --summary "$OUT"/ab-$side-*.json
    done
    (cd "$OUT" && tar czf "$(fresh ab-logs)" --remove-files ab-*.log ab-*.json);;
  host)
    sides=$(cd .ab && for d in */; do [ -d "$d/epjit" ] && echo "${d%/}"; done)
    for round in $(seq "$rounds"); do
      for side in $sides new; do
        path=${PYTHONPATH:-}
        [ $side = new ] || path=$PWD/.ab/$side${PYTHONPATH:+:$PYTHONPATH}
        PYTHONPATH=$path python3 scripts/host_path.py --json "$OUT/host-$side-$round.json" "$@" \
          > "$OUT/host-$side-$round.log" 2>&1 || { echo "$side round $round failed"; tail -20 "$OUT/host-$side-$round.log"; }
      done
    done
    for side in $sides new; do
      echo "=== $side ($([ $side = new ] && echo 'working tree' || cat ".ab/$side/.rev")): host us a call, by round"
      python3 - "$OUT"/host-$side-*.json <<'PY'
import json, sys
runs = [json.load(open(path)) for path in sys.argv[1:]]
for name in runs[0]["host_us"]:
    print(f"  {name:<32}" + "".join(f"{run['host_us'][name]:9.1f}" for run in runs))
PY
    done
    (cd "$OUT" && tar czf "$(fresh host-logs)" --remove-files host-*.log host-*.json);;
  *) echo "usage: gpu_ab.sh prepare REV [NAME] | save NAME | variant NAME [VAR=VALUE...] [-- bench args...] |" \
          "run [rounds] [bench arguments...]"; exit 2;;
esac
