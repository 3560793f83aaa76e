"""What the shrink-mode rank scripts share (low_latency_shrink.py, intranode_shrink.py): who leaves and when, the
mask read after a call, the result line, and each rank's work in a child process, so that a rank SIGKILLed is the
child and its rank exits 0 (the launcher, which ends the job when a rank fails, lets the survivors finish)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from low_latency import sync  # noqa: E402  (sibling rank script)

VICTIM, LEAVE_AT, ITERATIONS = 1, 3, 7


def read_mask(buf: Any, query: Callable[[Any], None], n: int) -> set[int]:
    """The ranks this rank's mask names, read through ``query`` (a Buffer's query call) after its earlier calls."""
    status = torch.zeros(n, dtype=torch.int32, device="cuda")
    query(status)
    sync(buf)
    return {int(r) for r in torch.nonzero(status).flatten().tolist()}


def finish(rank: int, mode: str, masks: list, after_clean: Any, reports: list[dict], started: float) -> None:
    """Print the survivor's ``RESULT {json}`` and leave: a Buffer shared with a dead rank cannot be closed
    collectively (docs/reliability.md)."""
    print("RESULT " + json.dumps({
        "rank": rank, "mode": mode, "masks": masks, "after_clean": after_clean,
        "reports": [{k: r[k] for k in ("rank", "peer", "site", "elapsed_ns")} for r in reports],
        "seconds": round(time.monotonic() - started, 1)}), flush=True)
    os._exit(0)


def run_in_child(script: str, worker: Callable[[str], int]) -> int:
    """``--mode update|stop|kill``: run ``worker(mode)`` in a child process of ``script`` (``--worker``), at most 240
    s; VICTIM's rank exits 0 when its child stopped or was killed as planned."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("update", "stop", "kill"), required=True)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args.mode)
    child = subprocess.run([sys.executable, script, "--mode", args.mode, "--worker"], check=False, timeout=240)
    rank = int(os.environ.get("EPJIT_RANK", "-1"))
    if rank == VICTIM and child.returncode in (0, -signal.SIGKILL):
        return 0
    return child.returncode
