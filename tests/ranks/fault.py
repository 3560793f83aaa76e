"""One rank of the fault tests: a rank dies (SIGKILL) or stops calling (sleeps) while the others are inside a
dispatch or combine kernel waiting for it. tests/test_gpu_faults.py runs it and checks how the job ends.

Every rank makes a Buffer, runs dispatch and combine once (so the kernels are compiled and loaded), prints
``READY <pid> <rank>/<size>`` and meets the others in a group barrier. Then the survivors print
``ENTERING <rank> <unix time>`` and enter the op, whose kernel waits for the victim's data, while the victim

- ``--how kill``: sleeps a second (the survivors are spinning in their kernel by then), prints
  ``KILLING <unix time>`` and sends itself SIGKILL;
- ``--how stall``: prints ``STALLING <unix time>`` and sleeps 60 s, alive but not calling.

A survivor that gets out of the op prints ``RESULT {json}`` with the error it saw (type and message) and raises it
again (the way a rank dies of an error; under MPI that aborts the job). A survivor the launcher ends first prints
nothing more: that is an outcome the test accepts too.

    EPJIT_TIMEOUT_S=5 python -m epjit.launch -n 2 tests/ranks/fault.py --mode normal --op combine --how kill
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

import epjit

HIDDEN, TOKENS, TOPK, EXPERTS = 2048, 64, 4, 64  # normal mode
LL_HIDDEN, LL_TOKENS, LL_TOPK, LL_EXPERTS = 1024, 16, 2, 8  # low-latency mode
STALL_S = 60


def routing(tokens: int, topk: int, experts: int) -> torch.Tensor:
    """topk distinct experts a token, so every rank sends to every other (the victim owns half the experts)."""
    return torch.rand(tokens, experts, device="cuda").argsort(dim=1)[:, :topk].contiguous()


class Normal:
    def __init__(self, group) -> None:
        self.buf = epjit.Buffer(group, num_nvl_bytes=epjit.Buffer.get_normal_size_hint(group.size, HIDDEN, TOPK,
                                                                                       EXPERTS))
        self.x = torch.randn(TOKENS, HIDDEN, device="cuda").to(torch.bfloat16)
        self.idx = routing(TOKENS, TOPK, EXPERTS)

    def dispatch(self):
        d = self.buf.dispatch(self.x, topk_idx=self.idx, num_experts=EXPERTS)  # waits for notify's counts
        self.buf.synchronize()
        return d

    def combine(self, d) -> None:
        self.buf.combine(d.x, d.handle)
        self.buf.synchronize()  # a kernel that gave up waiting raises EpjitTimeoutError here


class LowLatency:
    def __init__(self, group) -> None:
        self.buf = epjit.Buffer(group, low_latency_mode=True, num_max_dispatch_tokens_per_rank=LL_TOKENS,
                                hidden=LL_HIDDEN, num_experts=LL_EXPERTS)
        self.x = torch.randn(LL_TOKENS, LL_HIDDEN, device="cuda").to(torch.bfloat16)
        self.idx = routing(LL_TOKENS, LL_TOPK, LL_EXPERTS)
        self.w = torch.rand(LL_TOKENS, LL_TOPK, device="cuda")

    def dispatch(self):
        d = self.buf.low_latency_dispatch(self.x, self.idx, LL_TOKENS, LL_EXPERTS, use_fp8=False)
        self.buf.synchronize()  # the receive half waits for every rank's counts
        return d

    def combine(self, d) -> None:
        self.buf.low_latency_combine(d.x, self.idx, self.w, d.handle)
        self.buf.synchronize()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("normal", "low_latency"), required=True)
    p.add_argument("--op", choices=("dispatch", "combine"), required=True)
    p.add_argument("--how", choices=("kill", "stall"), required=True)
    p.add_argument("--victim", type=int, default=1)
    args = p.parse_args()

    group = epjit.init()
    torch.cuda.set_device(group.device)
    torch.manual_seed(1234 + group.rank)
    mode = Normal(group) if args.mode == "normal" else LowLatency(group)
    mode.combine(mode.dispatch())  # warm-up on every rank: both kernels compiled, loaded and run once
    d = mode.dispatch() if args.op == "combine" else None  # the combine under test needs a handle
    print(f"READY {os.getpid()} {group.rank}/{group.size}", flush=True)
    group.barrier()

    if group.rank == args.victim:
        if args.how == "kill":
            time.sleep(1.0)  # the survivors are inside their kernel, waiting for this rank
            print(f"KILLING {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(STALL_S)  # (SIGKILL cannot be caught: never reached)
        print(f"STALLING {time.time():.3f}", flush=True)
        time.sleep(STALL_S)  # alive, never calls; the launcher ends this rank once a survivor fails
        return 0

    start = time.time()
    print(f"ENTERING {group.rank} {start:.3f}", flush=True)
    result = {"rank": group.rank, "mode": args.mode, "op": args.op, "how": args.how, "victim": args.victim,
              "error_type": None, "error": None}
    try:
        if args.op == "dispatch":
            mode.dispatch()
        else:
            mode.combine(d)
    except Exception as e:  # noqa: BLE001 (whatever the survivor sees is the result; raised again below)
        result.update(error_type=type(e).__name__, error=str(e), seconds=round(time.time() - start, 2))
        print("RESULT " + json.dumps(result), flush=True)
        raise
    result["seconds"] = round(time.time() - start, 2)
    print("RESULT " + json.dumps(result), flush=True)  # the op finished without the victim: the test fails
    return 1


if __name__ == "__main__":
    sys.exit(main())
