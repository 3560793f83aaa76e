"""Run a notebook's engine cells (the ``%%px`` ones; by default the Jupyter tour's) as one script per rank, for GPU
machines without ipyparallel:

    python3 -m epjit.launch -n 2 scripts/notebook_gpu_cells.py [examples/notebooks/epjit_tour.ipynb]
    python3 -m epjit.launch -n 2 scripts/notebook_gpu_cells.py examples/notebooks/kernel_lab.ipynb

Each rank executes the cells in order, as an MPI engine of the notebook would; the notebook's own run under
ipyparallel is tests/test_notebooks.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1] / "examples" / "notebooks" / "epjit_tour.ipynb"


def engine_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return [s.split("\n", 1)[1] for s in sources if s.startswith("%%px")]


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    scope: dict[str, object] = {"__name__": "__engine__"}
    for i, source in enumerate(engine_cells(path)):
        exec(compile(source, f"{path.name}[px cell {i}]", "exec"), scope)
    return 0


if __name__ == "__main__":
    sys.exit(main())
