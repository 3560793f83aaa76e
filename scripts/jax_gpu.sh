#!/usr/bin/env bash
# The GPU check of epjit.jax (docs/jax.md), on a machine with GPUs and JAX's CUDA build installed (python3
# importing epjit, CuPy and JAX: set that environment up first):
#   bash scripts/jax_gpu.sh
# Runs tests/test_gpu_jax.py (2 and 4 ranks through python -m epjit.launch, one a GPU where there are enough, else
# sharing them), writes its log under $OUT and prints the table last. A few minutes, the kernels' first compile included.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/epjit-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)" || exit 1
nvidia-smi -L | head -8
t0=$(date +%s)
python3 -m pytest -m gpu -q -s -rA --timeout 400 tests/test_gpu_jax.py -p no:cacheprovider > "$OUT/jax-gpu.log" 2>&1
rc=$?
echo "=== tail of jax-gpu.log"; tail -c 5000 "$OUT/jax-gpu.log"
echo "=== table ($(( $(date +%s) - t0 )) s, pytest rc=$rc)"
grep -h "^jax |" "$OUT/jax-gpu.log" || echo "jax | no table: see $OUT/jax-gpu.log"
exit $rc
