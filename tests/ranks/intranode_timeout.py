"""Rank 1 never dispatches: rank 0's notify must time out with an error naming rank 1 (EPJIT_TIMEOUT_S low); with
num_nvl_ranks 1 the two ranks are two nodes, and the wait is on the RDMA leg.

    EPJIT_TIMEOUT_S=3 python -m epjit.launch -n 2 tests/ranks/intranode_timeout.py [num_nvl_ranks]
"""

from __future__ import annotations

import sys
import time

import torch
from intranode import normal_buffer  # noqa: E402  (sibling rank script)

import epjit


def main() -> int:
    group = epjit.init(num_nvl_ranks=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    torch.cuda.set_device(group.device)
    buf = normal_buffer(group, 2048, 4, 64)
    x = torch.randn(64, 2048, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 64, (64, 4), device="cuda")
    buf.dispatch(x, topk_idx=idx, num_experts=64)  # both ranks: works
    if group.rank == 1:
        time.sleep(60)  # never arrives; the launcher ends this rank once rank 0 fails
        return 0
    buf.dispatch(x, topk_idx=idx, num_experts=64)  # rank 0: notify waits for rank 1 and gives up
    return 0


if __name__ == "__main__":
    sys.exit(main())
