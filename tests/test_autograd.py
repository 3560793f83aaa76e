"""epjit.autograd without a GPU: a one-rank stand-in Buffer on the CPU (the semantics of docs/api.md at R = 1, in
torch) under the autograd Functions and the custom ops. Each MoE layer's outputs and gradients are compared with the
same layer computed densely (no dispatch, no combine), so a wrong adjoint, a lost weight or a misplaced row shows.

Skipped where torch is missing (the CPU tier has none)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="epjit.autograd needs torch, which this environment does not have")

import epjit  # noqa: E402
import epjit.autograd as ag  # noqa: E402
from epjit.errors import ArgumentError  # noqa: E402
from epjit.ops.intranode import CombineResult, DispatchResult  # noqa: E402
from epjit.ops.low_latency import (  # noqa: E402
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
    _Meta,
    meta_offsets,
)

BF16 = torch.bfloat16


class FakeHandle:
    """A normal-mode handle of the stand-in: which tokens were received, and the dispatch's sizes."""

    def __init__(self, tokens, num_tokens, num_rows, hidden, num_topk, num_recv_tokens, owner):
        self.tokens, self.num_tokens, self.num_rows = tokens, num_tokens, num_rows
        self.hidden, self.num_topk, self.num_recv_tokens, self.owner = hidden, num_topk, num_recv_tokens, owner


class FakeBuffer:
    """One rank on the CPU with torch tensors. Rows the semantics call undefined (worst-token padding, low-latency
    rows past recv_count) hold ``poison``; with ``shuffle`` a low-latency dispatch puts a token's repeated-expert rows
    in reverse k order every other call (the order is not specified), so only the handle's topk_slot says which."""

    num_ranks = 1

    def __init__(self, num_experts=8, hidden=64, num_max_dispatch_tokens_per_rank=16, poison=float("nan"),
                 shuffle=True):
        self.num_experts, self.hidden = num_experts, hidden
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.poison, self.shuffle, self.calls, self._closed = poison, shuffle, 0, False
        self.log = []  # the calls, by name: what backward ran

    # ---- normal mode

    def dispatch(self, x, topk_idx=None, topk_weights=None, handle=None, num_worst_tokens=0, num_experts=None,
                 **kwargs):
        assert not kwargs.get("async_finish"), "autograd must not pass async_finish"
        assert x.dtype == BF16 and x.is_contiguous(), (x.dtype, x.is_contiguous())
        self.log.append("dispatch" if handle is None else "dispatch(handle)")
        e = num_experts or self.num_experts
        if handle is not None:
            assert handle.owner is self and x.shape == (handle.num_tokens, handle.hidden)
            tokens = handle.tokens
        else:
            tokens = ((topk_idx >= 0) & (topk_idx < e)).any(1).nonzero().flatten()
        n = len(tokens)
        rows = num_worst_tokens or n
        assert n <= rows, "num_worst_tokens too small"
        recv_x = torch.full((rows, x.shape[1]), self.poison, dtype=BF16)
        recv_x[:n] = x[tokens]
        recv_idx = recv_w = None
        if topk_idx is not None:
            recv_idx = torch.full((rows, topk_idx.shape[1]), -1, dtype=torch.int64)
            recv_idx[:n] = torch.where(topk_idx < e, topk_idx, -1)[tokens]
        if topk_weights is not None:
            assert topk_weights.dtype == torch.float32
            recv_w = torch.zeros((rows, topk_idx.shape[1]), dtype=torch.float32)
            recv_w[:n] = torch.where(recv_idx[:n] >= 0, topk_weights[tokens], 0.0)
        known = -1 if num_worst_tokens else n
        k = topk_idx.shape[1] if topk_idx is not None else (handle.num_topk if handle is not None else 0)
        new = FakeHandle(tokens, x.shape[0], rows, x.shape[1], k, known, self)
        counts = [] if num_worst_tokens or handle is not None else \
            torch.bincount(recv_idx[recv_idx >= 0], minlength=e).tolist()
        return DispatchResult(recv_x, None, recv_idx, recv_w, counts, new, None)

    def combine(self, y, handle, topk_weights=None, bias=None, **kwargs):
        assert y.dtype == BF16 and y.shape == (handle.num_rows, handle.hidden) and handle.owner is self
        self.log.append("combine")
        n = len(handle.tokens)
        out = torch.zeros((handle.num_tokens, handle.hidden), dtype=torch.float32)
        out.index_add_(0, handle.tokens, y[:n].float())
        out_w = None
        if topk_weights is not None:
            assert topk_weights.dtype == torch.float32
            out_w = torch.zeros((handle.num_tokens, handle.num_topk), dtype=torch.float32)
            out_w.index_add_(0, handle.tokens, topk_weights[:n])
        return CombineResult(out.to(BF16), out_w, None)

    # ---- low latency

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
                             **kwargs):
        assert not kwargs.get("return_recv_hook") and not kwargs.get("async_finish")
        m, e, h = self.num_max_dispatch_tokens_per_rank, self.num_experts, self.hidden
        assert (num_max_dispatch_tokens_per_rank, num_experts) == (m, e) and x.shape[1] == h and x.dtype == BF16
        self.log.append("ll_dispatch")
        self.calls += 1
        offsets = meta_offsets(e, m, 1)
        owner = torch.full((offsets[-1],), -1, dtype=torch.int32)
        recv_x = torch.full((e, m, h), self.poison, dtype=BF16)
        src_info = owner[offsets[0]:offsets[0] + e * m].view(e, m)
        slot = owner[offsets[1]:offsets[1] + e * m].view(e, m)
        ranges = owner[offsets[2]:offsets[2] + 2 * e].view(torch.int64)
        count = owner[offsets[3]:offsets[3] + e]
        for g in range(e):
            t, k = (topk_idx == g).nonzero(as_tuple=True)  # row-major: by token, then k
            if self.shuffle and self.calls % 2 == 0:
                order = sorted(range(len(t)), key=lambda i: (int(t[i]), -int(k[i])))
                t, k = t[order], k[order]
            recv_x[g, :len(t)] = x[t]
            src_info[g, :len(t)], slot[g, :len(t)] = t.to(torch.int32), k.to(torch.int32)
            ranges[g], count[g] = len(t), len(t)  # begin 0 << 32 | count
        handle = LowLatencyHandle(m, h, e, topk_idx.shape[1], _Meta(owner, "torch", owner.data_ptr(), offsets,
                                                                    (e, m, 1)), id(self), [False])
        if use_fp8:
            return LowLatencyDispatchResult(recv_x.to(torch.float8_e4m3fn), torch.ones((e, m, h // 128)), handle,
                                            None, None)
        return LowLatencyDispatchResult(recv_x, None, handle, None, None)

    def low_latency_combine(self, y, topk_idx, topk_weights, handle, **kwargs):
        """out[t] = sum over k of w[t, k] * y[row of (t, k)], the rows found from the handle alone (as the kernel)."""
        assert type(handle) is LowLatencyHandle and handle.buffer_id == id(self)
        assert y.dtype == BF16 and topk_weights.dtype == torch.float32
        self.log.append("ll_combine")
        n, k = topk_idx.shape
        per_slot = torch.zeros((n, k, self.hidden), dtype=torch.float32)
        src, slot, count = handle.src_info, handle.topk_slot, handle.layout_range & 0xFFFFFFFF
        for g in range(self.num_experts):
            rows = int(count[g, 0])
            per_slot[src[g, :rows].long(), slot[g, :rows].long()] = y[g, :rows].float()
        out = torch.zeros((n, self.hidden), dtype=torch.float32)
        for j in range(k):  # in k order, as the semantics say
            out += torch.where((topk_idx[:, j] >= 0)[:, None], topk_weights[:, j, None] * per_slot[:, j], 0.0)
        return LowLatencyCombineResult(out.to(BF16), None, None)


# ------------------------------------------------------------------------------------------------ inputs


def routing(n, k, e, holes=0.2, repeats=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if repeats:
        idx = torch.randint(0, e, (n, k), generator=g)
    else:
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    idx[torch.rand((n, k), generator=g) < holes] = -1
    idx[0] = -1  # a token that goes nowhere
    weights = (torch.randint(1, 8, (n, k), generator=g) / 8).float()  # exact in bf16
    return idx, weights


def tokens(n, h, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 8, (n, h), generator=g) / 8).to(BF16)


def experts(e, h, seed=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-4, 5, (e, h, h), generator=g) / 16).float()


def dense_layer(x, idx, w, mats):
    """The MoE layer with no communication: out[t] = sum_k w[t, k] * (x[t] @ W[idx[t, k]])."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for j in range(idx.shape[1]):
        valid = idx[:, j] >= 0
        y = torch.einsum("th,thg->tg", x.float(), mats[idx[:, j].clamp(min=0)])
        out = out + torch.where(valid[:, None], w[:, j, None] * y, 0.0)
    return out


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def grads_of(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def close(a, b):
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def matches_dense_layer(out, coef, x, idx, w, mats) -> None:
    """``out`` (a layer through epjit.autograd on leaves x, w, mats) and its gradients equal the dense layer's: the
    loss is sum(out * coef), so every output element weighs differently. Every gradient is finite: padding rows
    (poisoned with NaN) gave none."""
    got = grads_of((out * coef).sum(), [x, w, mats])
    x2, w2, mats2 = leaves(x, w, mats)
    ref = dense_layer(x2, idx, w2, mats2)
    want = grads_of((ref * coef).sum(), [x2, w2, mats2])
    close(out, ref)
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        close(a, b)


# ------------------------------------------------------------------------------------------------ normal mode


def normal_layer(buf, x, idx, w, mats, weights_through_combine=False, **kwargs):
    """dispatch -> each received row through its local experts -> combine; with ``weights_through_combine`` the
    gate weights are applied after combine (combine's topk_weights output) instead of at the experts."""
    d = ag.dispatch(buf, x, idx, w, num_experts=buf.num_experts, **kwargs)
    valid = d.topk_idx >= 0
    y = torch.zeros(d.x.shape, dtype=torch.float32)
    for j in range(idx.shape[1]):
        ys = torch.einsum("rh,rhg->rg", torch.where(valid[:, j, None], d.x.float(), 0.0),
                          mats[d.topk_idx[:, j].clamp(min=0)])
        gate = torch.ones_like(d.topk_weights[:, j]) if weights_through_combine else d.topk_weights[:, j]
        y = y + torch.where(valid[:, j, None], gate[:, None] * ys, 0.0)
    if not weights_through_combine:
        return ag.combine(buf, y.to(BF16), d.handle).x.float()
    # Only valid for top-1 routing: out[t] = w[t] * expert(x[t]).
    c = ag.combine(buf, y.to(BF16), d.handle, topk_weights=d.topk_weights)
    return c.x.float() * c.topk_weights.sum(1, keepdim=True)


@pytest.mark.parametrize("num_worst_tokens", [0, 40])
def test_normal_layer_gradients_match_the_dense_layer(num_worst_tokens):
    buf = FakeBuffer()
    idx, w = routing(32, 3, buf.num_experts)
    x, w, mats = leaves(tokens(32, buf.hidden), w, experts(buf.num_experts, buf.hidden))
    coef = tokens(32, buf.hidden, seed=7).float()
    out = normal_layer(buf, x, idx, w, mats, num_worst_tokens=num_worst_tokens)
    matches_dense_layer(out, coef, x, idx, w, mats)
    assert buf.log.count("combine") == 2 and "dispatch(handle)" in buf.log  # forward + backward of each


def test_normal_combine_weights_gradient():
    """combine's topk_weights output is differentiable: its adjoint is a float32 replay of the weight gradient."""
    buf = FakeBuffer()
    idx, w = routing(24, 1, buf.num_experts, holes=0.0)
    x, w, mats = leaves(tokens(24, buf.hidden), w, experts(buf.num_experts, buf.hidden))
    out = normal_layer(buf, x, idx, w, mats, weights_through_combine=True)
    got = grads_of(out.sum(), [x, w, mats])
    x2, w2, mats2 = leaves(x, w, mats)
    want = grads_of(dense_layer(x2, idx, w2, mats2).sum(), [x2, w2, mats2])
    for a, b in zip(got, want, strict=True):
        close(a, b)
    assert buf.log.count("dispatch(handle)") == 2  # y's gradient and the weights' (packed) gradient


def test_normal_dispatch_weights_gradient_is_masked_to_local_slots():
    """A received weight is 0 where its slot names no local expert: those slots send no gradient home."""
    buf = FakeBuffer()
    idx, w = routing(16, 4, buf.num_experts)
    idx[:, 3] = buf.num_experts + 1  # outside [-1, E): never local (the real dispatch refuses the call)
    x, w = leaves(tokens(16, buf.hidden), w)
    d = ag.dispatch(buf, x, idx, w, num_experts=buf.num_experts)
    (grad_w,) = grads_of(d.topk_weights.sum(), [w])
    expect = ((idx >= 0) & (idx < buf.num_experts)).float()
    assert torch.equal(grad_w, expect)


# ------------------------------------------------------------------------------------------------ low latency


def ll_layer(buf, x, idx, w, mats):
    r = ag.low_latency_dispatch(buf, x, idx, buf.num_max_dispatch_tokens_per_rank, buf.num_experts, use_fp8=False)
    count = r.handle.layout_range & 0xFFFFFFFF  # rows past it are garbage: keep them out of the experts
    valid = torch.arange(r.x.shape[1])[None, :] < count.sum(1, keepdim=True)
    h = torch.where(valid[..., None], r.x.float(), 0.0)
    y = torch.einsum("erh,ehg->erg", h, mats).to(BF16)
    return ag.low_latency_combine(buf, y, idx, w, r.handle).x.float()


@pytest.mark.parametrize("repeats", [False, True])
@pytest.mark.parametrize("calls", [0, 1], ids=["forward-in-k-order", "forward-reversed"])
def test_low_latency_layer_gradients_match_the_dense_layer(repeats, calls):
    buf = FakeBuffer()
    buf.calls = calls  # which of the dispatches put a token's repeated rows in reverse k order
    idx, w = routing(12, 4, buf.num_experts, repeats=repeats, seed=3)
    x, w, mats = leaves(tokens(12, buf.hidden), w, experts(buf.num_experts, buf.hidden))
    coef = tokens(12, buf.hidden, seed=9).float()
    out = ll_layer(buf, x, idx, w, mats)
    matches_dense_layer(out, coef, x, idx, w, mats)
    # forward: dispatch, combine; combine's backward: grad_out and weights dispatched, dot products combined home;
    # dispatch's backward: one combine
    assert buf.log == ["ll_dispatch", "ll_combine", "ll_dispatch", "ll_dispatch", "ll_combine", "ll_combine"]


def test_low_latency_combine_gradients_alone():
    """Only the weights require grad: one dispatch and one combine, and exact sums for exact inputs."""
    buf = FakeBuffer()
    idx, w = routing(10, 2, buf.num_experts, seed=5)
    x = tokens(10, buf.hidden)
    r = buf.low_latency_dispatch(x, idx, buf.num_max_dispatch_tokens_per_rank, buf.num_experts, use_fp8=False)
    (w,) = leaves(w)
    out = ag.low_latency_combine(buf, r.x.nan_to_num(0.0), idx, w, r.handle).x
    (grad_w,) = grads_of(out.float().sum(), [w])
    want = torch.where(idx >= 0, x.float().sum(1, keepdim=True).expand_as(w), 0.0)
    close(grad_w, want)
    assert buf.log == ["ll_dispatch", "ll_combine", "ll_dispatch", "ll_combine"]


def test_row_map_follows_blocks_that_moved():
    """Another dispatch of the same routing may lay an expert's source blocks out elsewhere: each forward row maps to
    the row of the same block and position; rows of no block are not valid."""
    pack = ag._ll_row_map
    forward = torch.tensor([[(0 << 32) | 2, (2 << 32) | 3], [(0 << 32) | 0, (0 << 32) | 1]])
    moved = torch.tensor([[(3 << 32) | 2, (0 << 32) | 3], [(1 << 32) | 0, (0 << 32) | 1]])
    index, valid = pack(forward, moved, 6)
    assert index.tolist() == [[3, 4, 0, 1, 2, 0], [0, 0, 0, 0, 0, 0]]
    assert valid.tolist() == [[True] * 5 + [False], [True] + [False] * 5]


def test_float32_rides_bf16_rows_bit_for_bit():
    values = torch.tensor([[1.0 / 3, -2.5e-30, float("inf")], [7.0, 1e30, -0.0]])
    rows = ag._pack_f32(values, 8, "test")
    assert rows.dtype == BF16 and rows.shape == (2, 8)
    assert torch.equal(ag._unpack_f32(rows.clone(), 3).view(torch.int32), values.view(torch.int32))
    with pytest.raises(ArgumentError, match="needs hidden >= 6"):
        ag._pack_f32(values, 4, "test")


# ------------------------------------------------------------------------------------------------ refusals


def test_refusals_name_the_argument():
    buf = FakeBuffer()
    idx, w = routing(8, 2, buf.num_experts)
    x = tokens(8, buf.hidden).requires_grad_(True)
    fp8 = (x.detach().to(torch.float8_e4m3fn).requires_grad_(True), torch.ones(8, buf.hidden // 128))
    with pytest.raises(ArgumentError, match="FP8 x has no gradient"):
        ag.dispatch(buf, fp8, idx, w, num_experts=buf.num_experts)
    with pytest.raises(ArgumentError, match="async_finish=True"):
        ag.dispatch(buf, x, idx, w, num_experts=buf.num_experts, async_finish=True)
    with pytest.raises(ArgumentError, match="FP8 rows have no gradient"):
        ag.low_latency_dispatch(buf, x, idx, buf.num_max_dispatch_tokens_per_rank, buf.num_experts)
    with pytest.raises(ArgumentError, match="return_recv_hook=True"):
        ag.low_latency_dispatch(buf, x, idx, buf.num_max_dispatch_tokens_per_rank, buf.num_experts, use_fp8=False,
                                return_recv_hook=True)
    d = ag.dispatch(buf, x, idx, w, num_experts=buf.num_experts)
    bias = torch.zeros(8, buf.hidden, dtype=BF16, requires_grad=True)
    with pytest.raises(ArgumentError, match="bias has no gradient"):
        ag.combine(buf, d.x, d.handle, bias=bias)
    small = FakeBuffer(hidden=8)
    idx16, w16 = routing(4, 8, small.num_experts, holes=0.0)
    r = small.low_latency_dispatch(tokens(4, 8), idx16, 16, 8, use_fp8=False)
    with pytest.raises(ArgumentError, match="hidden >= 16"):
        ag.low_latency_combine(small, r.x.requires_grad_(True), idx16, w16, r.handle)
    with pytest.raises(ArgumentError, match="zero_copy=True"):
        ag.low_latency_combine(small, r.x, idx16, w16, r.handle, zero_copy=True)


def test_fp8_dispatch_without_gradient_passes_through():
    buf = FakeBuffer()
    idx, _ = routing(8, 2, buf.num_experts)
    r = ag.low_latency_dispatch(buf, tokens(8, buf.hidden), idx, buf.num_max_dispatch_tokens_per_rank,
                                buf.num_experts)
    assert r.x.dtype == torch.float8_e4m3fn and not r.x.requires_grad


def test_registry_ids_are_weak_and_refuse_closed_buffers():
    buf = FakeBuffer()
    i = ag.register(buf)
    assert ag.register(buf) == i and ag.lookup(i) is buf
    buf._closed = True
    with pytest.raises(ArgumentError, match=f"buffer_id={i} names no live Buffer"):
        ag.lookup(i)
    other = FakeBuffer()
    j = ag.register(other)
    assert j != i
    del other
    import gc

    gc.collect()
    with pytest.raises(ArgumentError, match="names no live Buffer"):
        ag.lookup(j)


def test_epjit_autograd_is_an_attribute_of_epjit():
    assert epjit.autograd is ag


# ------------------------------------------------------------------------------------------------ custom ops


def test_low_latency_custom_ops_pass_opcheck():
    buf = FakeBuffer(poison=0.0, shuffle=False)  # opcheck compares runs: no NaN garbage, the same order each call
    bid = ag.register(buf)
    idx, w = routing(10, 3, buf.num_experts, seed=11)
    x = tokens(10, buf.hidden).requires_grad_(True)
    torch.library.opcheck(torch.ops.epjit.ll_dispatch.default, (bid, x, idx, False, False, False))
    recv, _scales, _count, meta = torch.ops.epjit.ll_dispatch(bid, x.detach(), idx, False, False, False)
    y = recv.detach().clone().requires_grad_(True)
    torch.library.opcheck(torch.ops.epjit.ll_combine.default, (bid, y, idx, w.requires_grad_(True), meta))


def test_normal_custom_ops_pass_opcheck():
    buf = FakeBuffer(poison=0.0)
    bid = ag.register(buf)
    idx, w = routing(12, 2, buf.num_experts, seed=12)
    x = tokens(12, buf.hidden).requires_grad_(True)
    # The handle id differs on every call, so the tests that compare two runs' outputs are left out.
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.epjit.dispatch.default, (bid, x, idx, w.requires_grad_(True), 8, 20),
                          test_utils=checks)
    recv, _idx, _w, handle_id = torch.ops.epjit.dispatch(bid, x.detach(), idx, w.detach(), 8, 20)
    torch.library.opcheck(torch.ops.epjit.combine.default, (bid, recv.clone().requires_grad_(True), handle_id, 12),
                          test_utils=checks)


def _ll_step(bid, x, idx, w, mats):
    recv, _scales, count, meta = torch.ops.epjit.ll_dispatch(bid, x, idx, False, False, False)
    valid = torch.arange(recv.shape[1])[None, :] < count[:, None]
    y = torch.einsum("erh,ehg->erg", torch.where(valid[..., None], recv.float(), 0.0), mats).to(BF16)
    return torch.ops.epjit.ll_combine(bid, y, idx, w, meta).float()


def _normal_step(bid, x, idx, w, mats):
    recv, recv_idx, recv_w, handle_id = torch.ops.epjit.dispatch(bid, x, idx, w, 8, 40)
    valid = recv_idx >= 0
    y = torch.zeros(recv.shape, dtype=torch.float32)
    for j in range(idx.shape[1]):
        ys = torch.einsum("rh,rhg->rg", torch.where(valid[:, j, None], recv.float(), 0.0),
                          mats[recv_idx[:, j].clamp(min=0)])
        y = y + torch.where(valid[:, j, None], recv_w[:, j, None] * ys, 0.0)
    return torch.ops.epjit.combine(bid, y.to(BF16), handle_id, x.shape[0]).float()


@pytest.mark.parametrize("step", [_ll_step, _normal_step], ids=["low_latency", "normal"])
def test_compiled_layer_matches_the_dense_layer(step):
    """A MoE step on the custom ops traces with fullgraph=True (no graph break: the ops are opaque, their shapes
    static) and trains: outputs and gradients as the dense layer's."""
    torch._dynamo.reset()
    buf = FakeBuffer()
    bid = ag.register(buf)
    n = 12
    idx, w = routing(n, 3, buf.num_experts, seed=13)
    x, w, mats = leaves(tokens(n, buf.hidden), w, experts(buf.num_experts, buf.hidden))
    compiled = torch.compile(lambda *a: step(bid, *a), fullgraph=True, backend="aot_eager")
    coef = tokens(n, buf.hidden, seed=14).float()
    out = compiled(x, idx, w, mats)
    matches_dense_layer(out, coef, x, idx, w, mats)


def test_worst_token_combine_gives_padding_rows_zero_gradient():
    """Combine ignores padding rows, so their gradient is 0 (not the undefined rows a worst-token replay leaves)."""
    buf = FakeBuffer()
    idx, w = routing(16, 2, buf.num_experts)
    d = buf.dispatch(tokens(16, buf.hidden), idx, w, num_worst_tokens=40)
    (y,) = leaves(d.x.nan_to_num(0.0))
    (grad_y,) = grads_of(ag.combine(buf, y, d.handle).x.float().sum(), [y])
    received = len(d.handle.tokens)
    assert received < 40 and torch.equal(grad_y[received:], torch.zeros(40 - received, buf.hidden, dtype=BF16))
    assert torch.equal(grad_y[:received], torch.ones(received, buf.hidden, dtype=BF16))
