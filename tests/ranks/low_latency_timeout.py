"""Rank 1 stops sending: rank 0's low-latency dispatch must time out with an error naming rank 1 (EPJIT_TIMEOUT_S
low), never hang.

    EPJIT_TIMEOUT_S=3 python -m epjit.launch -n 2 tests/ranks/low_latency_timeout.py
"""

from __future__ import annotations

import sys
import time

import torch

import epjit


def main() -> int:
    group = epjit.init()
    torch.cuda.set_device(group.device)
    buf = epjit.Buffer(group, low_latency_mode=True, num_max_dispatch_tokens_per_rank=16, hidden=1024,
                       num_experts=8)
    x = torch.randn(16, 1024, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, 8, (16, 2), device="cuda")
    buf.low_latency_dispatch(x, idx, 16, 8)  # both ranks: works
    torch.cuda.synchronize()
    if group.rank == 1:
        time.sleep(60)  # stops sending; the launcher ends this rank once rank 0 fails
        return 0
    buf.low_latency_dispatch(x, idx, 16, 8)
    buf.synchronize()  # rank 0: the receive half waits for rank 1's counts and gives up
    return 0


if __name__ == "__main__":
    sys.exit(main())
