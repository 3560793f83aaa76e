#!/usr/bin/env bash
# The tests: lint, every kernel compiled and linked for sm_90 (no GPU needed), then the test suite.
# Without GPUs the GPU tier skips and says so; on GPU machines it runs too.
source "$(dirname "$0")/env.sh"
ruff check epjit tests examples scripts
python -m epjit.jit --check --arch sm_90
exec python -m pytest -q tests "$@"
