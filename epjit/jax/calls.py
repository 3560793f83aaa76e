"""The four calls of epjit.jax, their results and handles (pytrees), and their gradients (``jax.custom_vjp``).

What JAX brings, and how each call takes it:

- expert ids are int32 (JAX's default without 64-bit mode; int64 where it is on). The kernels read int64, so each
  call hands them ``int64_bits(topk_idx)``: int32 pairs, the low word and the sign, which are int64's bytes, built by
  XLA in the program (no 64-bit mode needed); received ids come back as int32.
- FP8 rows travel as uint8 (XLA's buffer interface has no float8 code everywhere) and are handed out as
  ``float8_e4m3fn`` by a bitcast in the program, which XLA compiles to no copy.

Gradients are the adjoint collectives on the forward's routing, as epjit.autograd's for torch: ``dispatch``'s
backward is a ``combine`` of the received rows' gradients (the received weights' gradient through combine's weights,
only at slots naming a local expert); ``combine``'s is a replay of the dispatch's routing (padding rows get zero);
``low_latency_dispatch``'s a ``low_latency_combine`` with weight 1 on every slot. ``low_latency_combine`` has no
gradient yet (docs/jax.md).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ArgumentError, ArgumentTypeError, with_rank
from ..ops.xla import HandleParts, HandleSizes
from .route import ROUTE

BF16 = jnp.bfloat16


def int64_bits(idx: Any) -> Any:
    """topk_idx as the kernels read it: ``[..., 2]`` int32, each pair an int64's bytes (little-endian)."""
    if idx.dtype == jnp.int64:
        return jax.lax.bitcast_convert_type(idx, jnp.int32)
    idx = idx.astype(jnp.int32)
    return jnp.stack([idx, jnp.where(idx < 0, -1, 0).astype(jnp.int32)], axis=-1)


def _no_grad(x: Any) -> Any:
    """The cotangent of an integer input: float0 zeros of its shape."""
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _check(x: Any, name: str, dtypes: tuple[Any, ...], shape: tuple[int | None, ...]) -> tuple[int, ...]:
    """Refuse an array of another dtype or shape (None: any size); its shape."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise ArgumentTypeError(with_rank(f"{name} must be a JAX array, got {type(x).__name__}"))
    if not any(jnp.issubdtype(x.dtype, d) for d in dtypes):
        names = " or ".join("an integer type" if d is jnp.integer else np.dtype(d).name for d in dtypes)
        raise ArgumentTypeError(with_rank(f"{name} must be {names}, got {x.dtype}"))
    if len(x.shape) != len(shape) or any(w is not None and w != s for w, s in zip(shape, x.shape, strict=True)):
        want = ", ".join("?" if w is None else str(w) for w in shape)
        raise ArgumentError(with_rank(f"{name} must have shape [{want}], got {list(x.shape)}"))
    return tuple(x.shape)


# ---------------------------------------------------------------------------------------------------- low latency


@jax.tree_util.register_pytree_node_class
class LowLatencyHandle:
    """What low_latency_combine needs of a dispatch: ``meta``, its int32 allocation (src_info, topk_slot,
    layout_range and recv_count: epjit.ops.low_latency.meta_offsets), a JAX array like any output."""

    def __init__(self, meta: Any, shape: tuple[int, int, int]) -> None:
        self.meta, self.shape = meta, shape  # shape: local experts, rows (R*M), ranks

    def tree_flatten(self) -> tuple[tuple[Any, ...], Any]:
        return (self.meta,), self.shape

    @classmethod
    def tree_unflatten(cls, shape: Any, children: Any) -> LowLatencyHandle:
        return cls(children[0], shape)

    def _part(self, i: int, n: int) -> Any:
        from ..ops.low_latency import meta_offsets

        start = meta_offsets(*self.shape)[i]
        return self.meta[start:start + n]

    @property
    def src_info(self) -> Any:
        """[L, R*M] int32: the source token of each received row."""
        local, rows, _ = self.shape
        return self._part(0, local * rows).reshape(local, rows)

    @property
    def recv_count(self) -> Any:
        """[L] int32: rows received by each local expert."""
        return self._part(3, self.shape[0])

    @property
    def layout_range(self) -> tuple[Any, Any]:
        """(begin, count), each [L, R] int32: where each source's block of rows starts, and its rows (the eager
        result's int64 ``begin << 32 | count``, as two int32 arrays)."""
        local, _, ranks = self.shape
        pairs = self._part(2, 2 * local * ranks).reshape(local, ranks, 2)
        return pairs[..., 1], pairs[..., 0]


class LowLatencyDispatch(NamedTuple):
    """x [L, R*M, H] float8_e4m3fn or bf16 (rows past recv_count are garbage); x_scales [L, R*M, H/128] float32
    (uint8 exponents with use_ue8m0) or None; recv_count [L] int32; handle."""

    x: Any
    x_scales: Any
    recv_count: Any
    handle: LowLatencyHandle


class _LowLatencyOptions(NamedTuple):
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool


def _ll_dispatch_raw(buf: Any, opts: _LowLatencyOptions, x: Any, bits: Any) -> tuple[Any, ...]:
    site = buf.xla_site("low_latency_dispatch", num_tokens=x.shape[0], num_topk=bits.shape[1], use_fp8=opts.use_fp8,
                        round_scale=opts.round_scale, use_ue8m0=opts.use_ue8m0)
    outs = ROUTE(site, x, bits)
    if opts.use_fp8:  # a float8 output, so that asking for its gradient reaches the backward, which refuses
        outs[0] = jax.lax.bitcast_convert_type(outs[0], jnp.float8_e4m3fn)
    return tuple(outs)


def _ll_combine_raw(buf: Any, y: Any, bits: Any, weights: Any, meta: Any) -> Any:
    site = buf.xla_site("low_latency_combine", num_tokens=bits.shape[0], num_topk=bits.shape[1])
    return ROUTE(site, y, bits, weights, meta)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ll_dispatch(buf: Any, opts: _LowLatencyOptions, x: Any, bits: Any) -> tuple[Any, ...]:
    return _ll_dispatch_raw(buf, opts, x, bits)


def _ll_dispatch_fwd(buf: Any, opts: _LowLatencyOptions, x: Any, bits: Any) -> tuple[Any, Any]:
    outs = _ll_dispatch_raw(buf, opts, x, bits)
    return outs, (bits, outs[-1])


def _ll_dispatch_bwd(buf: Any, opts: _LowLatencyOptions, res: Any, g: Any) -> tuple[Any, Any]:
    bits, meta = res
    if opts.use_fp8:
        raise ArgumentError(with_rank("low_latency_dispatch with use_fp8=True has no gradient (FP8 rows): dispatch "
                                      "bf16 (use_fp8=False) to train through it"))
    ones = jnp.ones(bits.shape[:2], jnp.float32)
    return _ll_combine_raw(buf, g[0].astype(BF16), bits, ones, meta), _no_grad(bits)


_ll_dispatch.defvjp(_ll_dispatch_fwd, _ll_dispatch_bwd)


def low_latency_dispatch(buf: Any, x: Any, topk_idx: Any, *, use_fp8: bool = True, round_scale: bool = False,
                         use_ue8m0: bool = False) -> LowLatencyDispatch:
    """``Buffer.low_latency_dispatch`` as an XLA operation: x [N, H] bf16 (N <= the Buffer's
    num_max_dispatch_tokens_per_rank, H its hidden), topk_idx [N, K] int32 (or int64). Differentiable in x when
    ``use_fp8=False``."""
    n, _ = _check(x, "x", (jnp.bfloat16,), (None, buf.hidden))
    _check(topk_idx, "topk_idx", (jnp.integer,), (n, None))
    opts = _LowLatencyOptions(bool(use_fp8), bool(round_scale), bool(use_ue8m0))
    outs = _ll_dispatch(buf, opts, x, int64_bits(topk_idx))
    local = buf.num_experts // buf.num_ranks
    handle = LowLatencyHandle(outs[-1], (local, buf.num_ranks * buf.num_max_dispatch_tokens_per_rank, buf.num_ranks))
    return LowLatencyDispatch(outs[0], outs[1] if use_fp8 else None, handle.recv_count, handle)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_combine(buf: Any, y: Any, bits: Any, weights: Any, meta: Any) -> Any:
    return _ll_combine_raw(buf, y, bits, weights, meta)


def _ll_combine_fwd(buf: Any, y: Any, bits: Any, weights: Any, meta: Any) -> tuple[Any, None]:
    return _ll_combine_raw(buf, y, bits, weights, meta), None


def _ll_combine_bwd(buf: Any, res: Any, g: Any) -> tuple[Any, ...]:
    raise ArgumentError(with_rank("the gradient of epjit.jax.low_latency_combine is not built yet: train through "
                                  "the normal-mode calls (epjit.jax.dispatch / combine with num_worst_tokens)"))


_ll_combine.defvjp(_ll_combine_fwd, _ll_combine_bwd)


def low_latency_combine(buf: Any, y: Any, topk_idx: Any, topk_weights: Any, handle: LowLatencyHandle) -> Any:
    """``Buffer.low_latency_combine`` as an XLA operation: y [L, R*M, H] bf16 in the layout the dispatch delivered,
    the topk_idx and topk_weights [N, K] (float32) this rank dispatched with; returns [N, H] bf16."""
    if not isinstance(handle, LowLatencyHandle):
        raise ArgumentTypeError(with_rank(f"handle must be the .handle of epjit.jax.low_latency_dispatch, got "
                                          f"{type(handle).__name__}"))
    local, rows, _ = handle.shape
    _check(y, "y", (jnp.bfloat16,), (local, rows, buf.hidden))
    n, k = _check(topk_idx, "topk_idx", (jnp.integer,), (None, None))
    _check(topk_weights, "topk_weights", (jnp.float32,), (n, k))
    return _ll_combine(buf, y, int64_bits(topk_idx), topk_weights, handle.meta)


# ---------------------------------------------------------------------------------------------------- normal mode


class _HandleStatic(NamedTuple):
    """What a normal-mode handle knows statically: the dispatch's sizes, rows and where its parts are."""

    sizes: HandleSizes
    num_worst_tokens: int
    parts: HandleParts
    in_rank_offset: int  # bytes into the layout scratch
    num_experts: int
    rank: int
    num_ranks: int


@jax.tree_util.register_pytree_node_class
class Handle:
    """A jitted dispatch's routing: ``ints`` (int32: its prefix matrices, receipts and status word, HandleParts) and
    ``layout`` (uint8: the layout it computed, is_token_in_rank inside), JAX arrays like any output."""

    def __init__(self, ints: Any, layout: Any, static: _HandleStatic) -> None:
        self.ints, self.layout, self.static = ints, layout, static

    def tree_flatten(self) -> tuple[tuple[Any, ...], Any]:
        return (self.ints, self.layout), self.static

    @classmethod
    def tree_unflatten(cls, static: Any, children: Any) -> Handle:
        return cls(children[0], children[1], static)

    @property
    def status(self) -> Any:
        """[] int32: what notify found (0: accepted; else the refusal's status bits, and every combine of this
        handle did nothing). The refusal itself is raised by the Buffer's next eager call or synchronize()."""
        return self.ints[self.static.parts.offsets[5]]

    @property
    def num_recv_tokens(self) -> Any:
        """[] int32: the rows that arrived (the rest of the num_worst_tokens rows are padding)."""
        s = self.static
        return self.ints[s.parts.offsets[0] + (s.num_ranks - 1) * s.num_ranks + s.rank]

    @property
    def is_token_in_rank(self) -> Any:
        s = self.static
        n, r = s.sizes.num_tokens, s.num_ranks
        return self.layout[s.in_rank_offset:s.in_rank_offset + n * r].reshape(n, r)


class Dispatch(NamedTuple):
    """x [W, H] bf16 (or float8_e4m3fn with x_scales [W, H/128] float32), topk_idx [W, K] int32 (local ids, -1
    elsewhere and in padding rows), topk_weights [W, K] float32, handle; W = num_worst_tokens."""

    x: Any
    x_scales: Any
    topk_idx: Any
    topk_weights: Any
    handle: Handle


class _DispatchOptions(NamedTuple):
    num_experts: int
    num_worst_tokens: int


def _dispatch_site(buf: Any, opts: _DispatchOptions, x: Any, bits: Any, fp8: bool) -> Any:
    return buf.xla_site("dispatch", num_tokens=x.shape[0], hidden=x.shape[1], num_topk=bits.shape[1],
                        num_experts=opts.num_experts, num_worst_tokens=opts.num_worst_tokens, fp8=fp8, replay=False)


def _static(buf: Any, site: Any, x: Any, bits: Any, opts: _DispatchOptions) -> _HandleStatic:
    sizes = HandleSizes(x.shape[0], x.shape[1], bits.shape[1], site.num_channels)
    return _HandleStatic(sizes, opts.num_worst_tokens, site.parts, site.in_rank_offset, opts.num_experts, buf.rank,
                        buf.num_ranks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch(buf: Any, opts: _DispatchOptions, x: Any, bits: Any, weights: Any) -> tuple[Any, ...]:
    return tuple(ROUTE(_dispatch_site(buf, opts, x, bits, False), x, bits, weights))


def _dispatch_fwd(buf: Any, opts: _DispatchOptions, x: Any, bits: Any, weights: Any) -> tuple[Any, Any]:
    site = _dispatch_site(buf, opts, x, bits, False)
    outs = tuple(ROUTE(site, x, bits, weights))
    return outs, (bits, outs[1], outs[3])


def _dispatch_bwd(buf: Any, opts: _DispatchOptions, res: Any, g: Any) -> tuple[Any, Any, Any]:
    bits, recv_bits, ints = res
    x = jax.ShapeDtypeStruct((bits.shape[0], g[0].shape[1]), BF16)  # (residuals are arrays only: sizes again)
    static = _static(buf, _dispatch_site(buf, opts, x, bits, False), x, bits, opts)
    # The forward put 0, not the weight, at slots naming no local expert: no gradient flows there.
    g_weights = jnp.where(recv_bits[..., 0] >= 0, g[2], 0.0).astype(jnp.float32)
    site = buf.xla_site("combine", sizes=static.sizes, num_worst_tokens=opts.num_worst_tokens, with_weights=True)
    g_x, g_w = ROUTE(site, g[0].astype(BF16), ints, g_weights)
    return g_x, _no_grad(bits), g_w


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def dispatch(buf: Any, x: Any, topk_idx: Any, topk_weights: Any, *, num_worst_tokens: int,
             num_experts: int | None = None) -> Dispatch:
    """``Buffer.dispatch(x, topk_idx=..., topk_weights=..., num_worst_tokens=...)`` as an XLA operation, inside one
    NVLink node: x [N, H] bf16 (or a pair (x [N, H] float8_e4m3fn or uint8 e4m3 bits, scales [N, H/128] float32)),
    topk_idx [N, K] int32 (or int64), topk_weights [N, K] float32; the outputs have num_worst_tokens rows (> 0).
    Differentiable in x (bf16) and topk_weights."""
    num_experts = buf.num_experts if num_experts is None else num_experts
    opts = _DispatchOptions(int(num_experts), int(num_worst_tokens))
    fp8 = isinstance(x, (tuple, list))
    if fp8:
        q, scales = x
        n, h = _check(q, "x", (jnp.float8_e4m3fn, jnp.uint8), (None, None))
        _check(scales, "x_scales", (jnp.float32,), (n, h // 128))
        q = jax.lax.bitcast_convert_type(q, jnp.uint8) if q.dtype != jnp.uint8 else q
    else:
        n, h = _check(x, "x", (jnp.bfloat16,), (None, None))
    _, k = _check(topk_idx, "topk_idx", (jnp.integer,), (n, None))
    _check(topk_weights, "topk_weights", (jnp.float32,), (n, k))
    bits = int64_bits(topk_idx)
    if fp8:  # no gradient: FP8 rows have none (dispatch bf16 to train through it)
        site = _dispatch_site(buf, opts, q, bits, True)
        recv_x, recv_scales, recv_bits, recv_w, ints, layout = ROUTE(site, q, scales, bits, topk_weights)
        recv_x = jax.lax.bitcast_convert_type(recv_x, jnp.float8_e4m3fn)
    else:
        # the handle's static sizes (the call's own site is built inside, where gradients can trace it again)
        site = _dispatch_site(buf, opts, x, bits, False)
        recv_x, recv_bits, recv_w, ints, layout = _dispatch(buf, opts, x, bits, topk_weights)
        recv_scales = None
    handle = Handle(ints, layout, _static(buf, site, x if not fp8 else q, bits, opts))
    return Dispatch(recv_x, recv_scales, recv_bits[..., 0], recv_w, handle)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _combine(buf: Any, static: _HandleStatic, y: Any, ints: Any, layout: Any) -> Any:
    site = buf.xla_site("combine", sizes=static.sizes, num_worst_tokens=static.num_worst_tokens, with_weights=False)
    return ROUTE(site, y, ints)[0]


def _combine_fwd(buf: Any, static: _HandleStatic, y: Any, ints: Any, layout: Any) -> tuple[Any, Any]:
    return _combine(buf, static, y, ints, layout), (ints, layout)


def _combine_bwd(buf: Any, static: _HandleStatic, res: Any, g: Any) -> tuple[Any, Any, Any]:
    ints, layout = res
    s = static.sizes
    site = buf.xla_site("dispatch", num_tokens=s.num_tokens, hidden=s.hidden, num_topk=s.num_topk,
                        num_experts=static.num_experts, num_worst_tokens=static.num_worst_tokens, fp8=False,
                        replay=True)
    handle = Handle(ints, layout, static)
    g_y = ROUTE(site, g.astype(BF16), ints, handle.is_token_in_rank)[0]
    rows = jnp.arange(static.num_worst_tokens)[:, None]
    return jnp.where(rows < handle.num_recv_tokens, g_y, jnp.zeros_like(g_y)), _no_grad(ints), _no_grad(layout)


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(buf: Any, y: Any, handle: Handle) -> Any:
    """``Buffer.combine(y, handle)`` as an XLA operation: y [W, H] bf16, the rows the dispatch delivered (padding
    rows are ignored); returns [N, H] bf16. Differentiable in y."""
    if not isinstance(handle, Handle):
        raise ArgumentTypeError(with_rank(f"handle must be the .handle of epjit.jax.dispatch, got "
                                          f"{type(handle).__name__}"))
    s = handle.static
    _check(y, "y", (jnp.bfloat16,), (s.num_worst_tokens, s.sizes.hidden))
    return _combine(buf, s, y, handle.ints, handle.layout)
