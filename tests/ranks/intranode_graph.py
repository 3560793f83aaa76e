"""One rank of the CUDA-graph check: worst-token dispatch + combine captured once in a torch CUDA graph, replayed
with new inputs copied into the captured tensors, checked against epjit.reference each replay; and a captured
dispatch whose num_worst_tokens is too small, whose replay must be reported by the next eager look.

    python -m epjit.launch -n 2 tests/ranks/intranode_graph.py [num_nvl_ranks]
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from intranode import make_inputs, normal_buffer, same, to_numpy, to_torch  # noqa: E402  (sibling rank script)

import epjit
from epjit import reference


def main() -> int:
    group = epjit.init(num_nvl_ranks=int(sys.argv[1]) if len(sys.argv) > 1 else None)
    torch.cuda.set_device(group.device)
    R, rank = group.size, group.rank
    nodes = group.num_nvl_ranks if group.num_nvl_ranks < R else None
    tokens, hidden, topk, experts = 256, 4096, 8, 64
    worst = tokens * R
    buf = normal_buffer(group, hidden, topk, experts)
    xs, idxs, ws = make_inputs(99, [tokens] * R, hidden, topk, experts, 0.2)
    x, idx, w = to_torch(xs[rank]), to_torch(idxs[rank]), to_torch(ws[rank])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def step():
        layout = buf.get_dispatch_layout(idx, experts)
        d = buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=layout, num_worst_tokens=worst)
        c = buf.combine(d.x, d.handle, topk_weights=d.topk_weights)
        return d, c

    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up: kernels loaded, CuPy's pool holds blocks of every size the step needs
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the stream the warm-up filled CuPy's pool on
        d, c = step()
    result = {"rank": rank, "replays": 0}

    # num_worst_tokens below what arrives: notify refuses the replay on every rank (the kernels do nothing) and
    # the next eager look, here synchronize, raises; the graph above still replays correctly afterwards.
    def refused_step():
        layout = buf.get_dispatch_layout(idx, experts)
        return buf.dispatch(x, topk_idx=idx, topk_weights=w, layout=layout, num_worst_tokens=8)

    with torch.cuda.stream(stream):
        refused_step()  # warm-up (refused too): CuPy's pool gets the blocks the capture takes
    torch.cuda.synchronize()
    try:
        buf.synchronize()
    except epjit.ArgumentError:
        pass
    refused = torch.cuda.CUDAGraph()
    with torch.cuda.graph(refused, stream=stream):
        kept = refused_step()  # held: its CuPy blocks stay the graph's
    group.barrier()
    refused.replay()
    torch.cuda.synchronize()  # the replay runs on this stream, not the Buffer's
    try:
        buf.synchronize()
        result["graph_refusal"] = None
    except epjit.ArgumentError as e:
        result["graph_refusal"] = str(e)[:240]
    del kept
    for replay in range(5):
        xs, idxs, ws = make_inputs(100 + replay, [tokens] * R, hidden, topk, experts, 0.2)
        x.copy_(to_torch(xs[rank]))
        idx.copy_(to_torch(idxs[rank]))
        w.copy_(to_torch(ws[rank]))
        group.barrier()
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.dispatch(xs, idxs, ws, experts)
        m = ref[rank].handle.num_recv_tokens
        same("graph recv_x", to_numpy(d.x)[:m], ref[rank].x)
        same("graph recv_topk_idx", to_numpy(d.topk_idx)[:m], ref[rank].topk_idx)
        same("graph padding", to_numpy(d.topk_idx)[m:], np.full((worst - m, topk), -1, np.int64))
        c_ref = reference.combine([r.x for r in ref], [r.handle for r in ref],
                                  topk_weights=[r.topk_weights for r in ref], num_nvl_ranks=nodes)
        same("graph combined_x", to_numpy(c.x), c_ref[rank].x)
        result["replays"] += 1
    buf.close()
    print("RESULT " + json.dumps(result), flush=True)
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
