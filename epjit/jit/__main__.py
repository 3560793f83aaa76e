"""``python -m epjit.jit --check``: the program that builds epjit's kernels. Being the program, it is the one file of
``epjit/jit/`` that imports from above: it hands the JIT layer epjit's kernel specs (the product's and the
benchmark's) and configuration."""

from __future__ import annotations

import sys

from epjit.bench.kernels import bench_specs
from epjit.jit.cli import main
from epjit.kernels import check_specs, jit_config

if __name__ == "__main__":
    sys.exit(main(None, lambda: [*check_specs(), *bench_specs()], jit_config()))
