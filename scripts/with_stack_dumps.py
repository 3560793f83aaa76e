"""Run a Python script with every thread's stack written to stderr every STACK_DUMP_S seconds (default 60): where a
slow or stuck run is, under a tool that hides it (compute-sanitizer runs the process; a hang shows no Python frames).

    STACK_DUMP_S=30 python scripts/with_stack_dumps.py SCRIPT [ARGS ...]
    SANITIZE_STACK_DUMP_S=60 bash scripts/sanitize.sh memcheck        (what scripts/sanitize.sh does with it)
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(f"usage: STACK_DUMP_S=SECONDS {sys.argv[0]} SCRIPT [ARGS ...]")
    try:
        every = float(os.environ.get("STACK_DUMP_S", "60"))
    except ValueError:
        every = 0.0
    if not every > 0:
        sys.exit(f"STACK_DUMP_S must be a positive number of seconds, got {os.environ['STACK_DUMP_S']!r}")
    faulthandler.dump_traceback_later(every, repeat=True, file=sys.stderr)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as if the script had been run itself
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
