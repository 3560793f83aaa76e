# Sourced by scripts/example.sh and scripts/test.sh: creates .venv (once) and installs epjit into it, editable,
# with what this machine can use: the test tools everywhere (test), plus, where there is no NVIDIA driver, the
# CUDA 13 compiler wheels (compile13: every kernel compiles and links for sm_90 with no GPU) and PyTorch's CPU build
# (so the torch tests run on CPU rather than skip), or, where there is a driver, the whole CUDA 13 GPU stack (cuda13,
# which includes compile13). A GPU machine brings its own CUDA build of torch: nothing here installs or replaces it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
extras=test,compile13
# The CPU build of torch 2.13.0, pinned: pip takes the local +cpu wheel where the machine offers one (its
# find-links), while a bare "torch" or a later release resolves to the CUDA build on PyPI (several GB).
# docs/testing.md says what it costs and how to get the CPU build where no local wheel is offered.
cpu_torch=torch==2.13.0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras=test,cuda13
  cpu_torch=
fi
stamp=.venv/.epjit-installed-$extras${cpu_torch:+-cpu-torch}-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -e "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]" ${cpu_torch:+"$cpu_torch"}
  touch "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
