"""``python -m epjit.bench``: see epjit.bench.cli."""

import sys

from epjit.bench.cli import main

sys.exit(main())
