"""``python -m epjit.jit --check``: the program that builds the kernel modules the packages above register
(registry.py), so this layer needs no import from above to find them."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
