# Sourced by scripts/example.sh and scripts/test.sh: creates .venv (once) and installs epjit into it, editable,
# with what this machine can use: the test tools everywhere (test), plus the CUDA 13 compiler wheels where there
# is no NVIDIA driver (compile13: every kernel compiles and links for sm_90 with no GPU) or the whole CUDA 13 GPU
# stack where there is one (cuda13, which includes compile13).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
extras=test,compile13
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras=test,cuda13
fi
stamp=.venv/.epjit-installed-$extras-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -e "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  touch "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
