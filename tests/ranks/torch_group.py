"""Run by every rank under torchrun (``python -m torch.distributed.run --nproc-per-node N``): epjit's group over
torch.distributed, on the CPU (bind_device=False).

argv: case. ``default``: the script makes no process group, so epjit.init() creates a gloo one and destroys it on
close. ``own``: the script makes its gloo group first, epjit joins it and leaves it up. ``subgroup``: every rank
but the last joins a torch subgroup through ``epjit.init(torch_group=...)``. ``stall``: rank 1 comes to a barrier
after EPJIT_COLLECTIVE_TIMEOUT_S. Prints ``RESULT {json}`` per rank.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

import epjit
from epjit import ArgumentError, ArgumentTypeError


def collectives(group: epjit.Group) -> dict:
    """What every rank checks of a group: rank, size, the collectives, an argument that differs."""
    r, n = group.rank, group.size
    out: dict = {"rank": r, "size": n, "backend": group.backend, "local": [group.local_rank, group.local_size],
                 "nvl": [group.num_nvl_ranks, group.nvl_rank], "device": group.device}
    big = bytes((r * 31 + i) % 251 for i in range(70_000 + r))  # uneven lengths, non-constant bytes
    got = group.allgather_object(big)
    out["allgather_ok"] = all(g == bytes((q * 31 + i) % 251 for i in range(70_000 + q)) for q, g in enumerate(got))
    out["empty_ok"] = group.allgather_object(b"") == [b""] * n
    out["bcast"] = group.bcast_bytes(b"root payload" if r == n - 1 else None, root=n - 1).decode()
    group.barrier()
    try:
        group.check_same("hidden", 7168 if r == 0 else 4096)
        out["differs"] = None
    except ArgumentError as e:
        out["differs"] = str(e)
    try:
        group.allgather_object((lambda: None) if r == 0 else 1)  # rank 0 cannot pickle: every rank raises
        out["unpicklable"] = None
    except (ArgumentError, ArgumentTypeError, epjit.CollectiveError) as e:
        out["unpicklable"] = f"{type(e).__name__}: {e}"
    return out


def main() -> int:
    case = sys.argv[1]
    rank = int(os.environ["RANK"])
    result: dict = {"case": case}
    if case == "default":
        group = epjit.init(bind_device=False)
        result.update(collectives(group))
        result["again_same"] = epjit.init() is group
        group.close()
        result["default_destroyed"] = not dist.is_initialized()
    elif case == "own":
        dist.init_process_group("gloo")
        group = epjit.init(bind_device=False)
        result.update(collectives(group))
        try:
            epjit.init(torch_group=dist.new_group(backend="gloo"))
            result["other_group"] = None
        except ArgumentError as e:
            result["other_group"] = str(e)
        group.close()
        result["default_kept"] = dist.is_initialized()
        dist.destroy_process_group()
    elif case == "subgroup":
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        sub = dist.new_group(list(range(world - 1)), backend="gloo")
        if rank < world - 1:
            group = epjit.init(torch_group=sub, bind_device=False)
            result.update(collectives(group))
            group.close()
        else:
            result.update({"rank": rank, "outside": True})
        dist.barrier()
        dist.destroy_process_group()
    elif case == "stall":  # rank 1 comes late to a barrier: the others raise once EPJIT_COLLECTIVE_TIMEOUT_S passes
        group = epjit.init(bind_device=False)
        start = time.monotonic()
        if rank == 1:
            time.sleep(float(os.environ["EPJIT_COLLECTIVE_TIMEOUT_S"]) + 4)
        try:
            group.barrier()
            result["stall_error"] = None
        except epjit.CollectiveError as e:
            result["stall_error"] = str(e)
        result["waited_s"] = round(time.monotonic() - start, 1)
        result["broken"] = group.broken is not None
        group.close()
    else:
        raise SystemExit(f"unknown case {case}")
    result["global_rank"] = rank
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
