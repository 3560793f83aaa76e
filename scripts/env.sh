# Sourced by scripts/example.sh and scripts/test.sh: creates .venv (once) and installs epjit into it with what
# this machine can use: the CPU tier's tools everywhere, the CUDA 13 GPU stack where an NVIDIA driver is present.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
extras=test
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
