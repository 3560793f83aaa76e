"""Run by every rank under torchrun (any number of ranks; the tests run 2 and 4): a normal-mode Buffer made from a
torch ProcessGroup, as DeepEP's callers make theirs, checked against epjit.reference (dispatch and combine, bf16 and
FP8).

argv: ``gloo`` or ``nccl`` (the script makes the default group with that backend and passes it to Buffer), or
``none`` (the script makes no group: epjit.init() creates a gloo one). Prints ``RESULT {json}`` per rank.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from intranode import Mismatch, run_case  # tests/ranks/intranode.py, beside this script

import epjit


def main() -> int:
    backend = sys.argv[1]
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # NCCL's collectives run on the current device
    if backend != "none":
        dist.init_process_group(backend)
        handle = dist.group.WORLD
    else:
        handle = epjit.init()
    result: dict = {"backend": backend, "global_rank": int(os.environ["RANK"]), "cases": 0}
    hint = epjit.Buffer.get_normal_size_hint(int(os.environ["WORLD_SIZE"]), 2048, 4, 64)
    buf = epjit.Buffer(handle, num_nvl_bytes=hint)
    group = buf.group
    torch.cuda.set_device(group.device)
    result.update(rank=group.rank, size=group.size, group_backend=group.backend, same_group=epjit.init() is group)
    R = group.size
    try:
        for i, fp8 in enumerate((False, True)):
            run_case(buf, group.rank, R, seed=300 + i, counts=[120 + 17 * r for r in range(R)], hidden=2048, topk=4,
                     num_experts=64, fp8=fp8, holes=0.1)
            result["cases"] += 1
        result["mismatch"] = None
    except Mismatch as e:
        result["mismatch"] = str(e)[:400]
    finally:
        buf.close()
    group.close()
    result["default_group_left"] = dist.is_initialized()
    if backend != "none":
        dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result["mismatch"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
