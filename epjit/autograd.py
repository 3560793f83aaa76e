"""torch autograd and torch.compile support: dispatch and combine as differentiable torch operations.

Only torch users import this module (``import epjit.autograd``); ``import epjit`` never loads torch. docs/torch.md
describes it. Two layers:

- Autograd Functions around a Buffer's calls (``dispatch``, ``combine``, ``low_latency_dispatch``,
  ``low_latency_combine``): each call's backward is the adjoint collective on the same routing (combine for
  dispatch, a handle replay of dispatch for combine), so a MoE layer built from them trains like any torch layer.
- torch custom ops (``torch.ops.epjit.*``, registered when this module is imported) for the calls whose output
  shapes follow from their arguments alone, so a layer built from them traces under ``torch.compile(fullgraph=True)``.
  A custom op cannot take a Buffer: ``register(buffer)`` gives the int id the ops take.

Every backward is collective, like the forward: every rank must run the backward of the same calls in the same order
(which the same model and loss on every rank does).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

from .errors import ArgumentError, with_rank
from .ops.intranode import CombineResult, DispatchResult
from .ops.low_latency import (
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
    _Meta,
    meta_offsets,
)

__all__ = ["combine", "dispatch", "low_latency_combine", "low_latency_dispatch", "lookup", "register", "unregister"]

# ------------------------------------------------------------------------------------------------ Buffer registry

_BUFFERS: dict[int, weakref.ref] = {}
_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NEXT_ID = itertools.count(1)  # never reused: an id whose Buffer is gone must not name a later one


def register(buffer: Any) -> int:
    """The int id custom ops take for ``buffer`` (the same id on every call). Held weakly: the entry goes when the
    Buffer is collected, or with ``unregister``; a closed Buffer's id is refused."""
    found = _IDS.get(buffer)
    if found is not None:
        return found
    buffer_id = next(_NEXT_ID)
    _BUFFERS[buffer_id] = weakref.ref(buffer, lambda _ref, i=buffer_id: _BUFFERS.pop(i, None))
    _IDS[buffer] = buffer_id
    return buffer_id


def unregister(buffer: Any) -> None:
    """Forget ``buffer``'s id (call it when closing a Buffer that custom ops used)."""
    buffer_id = _IDS.pop(buffer, None)
    if buffer_id is not None:
        _BUFFERS.pop(buffer_id, None)


def lookup(buffer_id: int) -> Any:
    """The live Buffer registered under ``buffer_id``."""
    ref = _BUFFERS.get(buffer_id)
    buffer = ref() if ref is not None else None
    if buffer is None or getattr(buffer, "_closed", False):
        _BUFFERS.pop(buffer_id, None)
        raise ArgumentError(with_rank(f"buffer_id={buffer_id} names no live Buffer (closed, collected or never "
                                      "registered): use epjit.autograd.register(buffer)"))
    return buffer


# ------------------------------------------------------------------------------------------------ helpers


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).contiguous()


def _pack_f32(values: torch.Tensor, hidden: int, what: str) -> torch.Tensor:
    """float32 [N, K] as the bits of a bf16 [N, hidden] row (2K columns, the rest 0): dispatch copies rows bit for
    bit, so this carries float32 values to where the rows go without rounding them."""
    n, k = values.shape
    if hidden < 2 * k:
        raise ArgumentError(with_rank(f"{what} carries top-{k} float32 weights in a row of hidden={hidden}, which "
                                      f"needs hidden >= {2 * k}"))
    rows = torch.zeros((n, hidden), dtype=torch.bfloat16, device=values.device)
    rows[:, :2 * k] = values.to(torch.float32).contiguous().view(torch.bfloat16)
    return rows


def _unpack_f32(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The float32 [..., K] that _pack_f32 put into the first 2K columns of ``rows``."""
    return rows[..., :2 * k].contiguous().view(torch.float32)


def _check_kwargs(kwargs: dict[str, Any], what: str, refused: tuple[str, ...]) -> None:
    """Refuse the arguments whose meaning an autograd graph cannot keep (docs/torch.md: refusals)."""
    for name in refused:
        value = kwargs.get(name)
        if value is not None and value is not False:
            raise ArgumentError(with_rank(f"epjit.autograd.{what} does not take {name}={value!r}: backward runs on "
                                          "autograd's stream, after the forward's results are ready"))


def _needs_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# ------------------------------------------------------------------------------------------------ adjoints


def dispatch_adjoint(buffer: Any, handle: Any, grad_x: torch.Tensor, grad_weights: torch.Tensor | None,
                     recv_topk_idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normal dispatch's backward: a combine of the received rows' gradients on the dispatch's handle. A received
    weight is the sender's where the slot names a local expert and 0 elsewhere, so only those slots' gradients go
    back (combine sums whatever it is given)."""
    weights = None
    if grad_weights is not None:
        assert recv_topk_idx is not None
        weights = torch.where(recv_topk_idx >= 0, grad_weights.to(torch.float32), 0.0).contiguous()
    result = buffer.combine(_bf16(grad_x), handle, topk_weights=weights)
    return result.x, result.topk_weights


def _replay(buffer: Any, handle: Any, x: torch.Tensor) -> torch.Tensor:
    """x [N, H] dispatched along ``handle``'s routing, as [handle.num_rows, H]. A worst-token handle's replay waits
    for the row count (the host never learnt it) and pads with zero rows: combine ignored the padding, so its
    gradient there is 0, and undefined rows would reach the experts' backward."""
    rows = buffer.dispatch(x, handle=handle).x
    missing = handle.num_rows - rows.shape[0]
    return torch.nn.functional.pad(rows, (0, 0, 0, missing)) if missing > 0 else rows


def combine_adjoint(buffer: Any, handle: Any, grad_out: torch.Tensor,
                    grad_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normal combine's backward: out[t] sums the rows returned for t, so each row's gradient is grad_out of its
    source token, a dispatch of grad_out replayed on the handle; the combined weights likewise, carried as float32
    bits in a second replay."""
    grad_y = _replay(buffer, handle, _bf16(grad_out))
    grad_recv_weights = None
    if grad_weights is not None:
        packed = _pack_f32(grad_weights, handle.hidden, "the gradient of combine's topk_weights")
        grad_recv_weights = _unpack_f32(_replay(buffer, handle, packed), handle.num_topk)
    return grad_y, grad_recv_weights


def ll_dispatch_adjoint(buffer: Any, handle: LowLatencyHandle, topk_idx: torch.Tensor,
                        grad_x: torch.Tensor) -> torch.Tensor:
    """Low-latency dispatch's backward: each received row is a copy of its source token, so a token's gradient is
    the sum of its rows' gradients: low_latency_combine on the forward's handle with weight 1 on every slot."""
    ones = (topk_idx >= 0).to(torch.float32)
    return buffer.low_latency_combine(_bf16(grad_x), topk_idx, ones, handle).x


def _ll_row_map(forward_range: torch.Tensor, new_range: torch.Tensor,
                rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of the forward's layout, its row in another dispatch of the same routing, and whether it holds a
    token. Source blocks may lie elsewhere in another call, but each holds the same tokens in the same order."""
    begin, count = forward_range >> 32, forward_range & 0xFFFFFFFF  # [L, R]
    shift = (new_range >> 32) - begin
    j = torch.arange(rows, device=forward_range.device)
    inside = (j >= begin[..., None]) & (j < (begin + count)[..., None])  # [L, R, rows]
    valid = inside.any(1)
    index = j + (inside * shift[..., None]).sum(1)
    return torch.where(valid, index, 0), valid


def _ll_rows_home(buffer: Any, handle: LowLatencyHandle, topk_idx: torch.Tensor,
                  payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``payload`` [N, H] bf16 of every source token, sent where the forward's rows came from (a bf16 low-latency
    dispatch) and laid out as the forward's handle: [L, R*max, H], and which rows hold a token."""
    sent = buffer.low_latency_dispatch(payload, topk_idx, handle.num_max_dispatch_tokens_per_rank,
                                       handle.num_experts, use_fp8=False)
    index, valid = _ll_row_map(handle.layout_range, sent.handle.layout_range, sent.x.shape[1])
    return torch.gather(sent.x, 1, index[..., None].expand(-1, -1, sent.x.shape[2])), valid


def ll_combine_adjoint(buffer: Any, handle: LowLatencyHandle, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       y: torch.Tensor, grad_out: torch.Tensor, need_y: bool,
                       need_weights: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Low-latency combine's backward. out[t] = sum_k w[t, k] * y[row(t, k)], so
    grad_y[row(t, k)] = w[t, k] * grad_out[t] and grad_w[t, k] = <grad_out[t], y[row(t, k)]>. grad_out goes to the
    rows by a bf16 dispatch; the weights, needed where the rows are, by a second one (float32 bits); each row knows
    its k (handle.topk_slot). grad_w is summed where y is and comes home by a combine that puts each row's sum in
    column k (so it is rounded to bf16)."""
    k = topk_idx.shape[1]
    g_rows, valid = _ll_rows_home(buffer, handle, topk_idx, _bf16(grad_out))
    slot = handle.topk_slot.to(torch.int64).clamp(0, k - 1)[..., None]  # rows without a token: masked below
    grad_y = grad_w = None
    if need_y:
        packed = _pack_f32(topk_weights, handle.hidden, "the gradient of low_latency_combine's y")
        w_rows, _ = _ll_rows_home(buffer, handle, topk_idx, packed)
        w_row = torch.gather(_unpack_f32(w_rows, k), 2, slot)
        grad_y = torch.where(valid[..., None], g_rows.to(torch.float32) * w_row, 0.0).to(torch.bfloat16)
    if need_weights:
        dots = torch.where(valid, (g_rows.to(torch.float32) * y.to(torch.float32)).sum(-1), 0.0)
        columns = torch.zeros(y.shape, dtype=torch.float32, device=y.device).scatter_(2, slot, dots[..., None])
        ones = (topk_idx >= 0).to(torch.float32)
        home = buffer.low_latency_combine(_bf16(columns), topk_idx, ones, handle).x
        grad_w = torch.where(topk_idx >= 0, home[:, :k].to(torch.float32), 0.0)
    return grad_y, grad_w


# ------------------------------------------------------------------------------------------------ autograd Functions


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor | None, buffer: Any, topk_idx: Any,
                kwargs: dict[str, Any]) -> tuple[Any, ...]:
        d = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, **kwargs)
        ctx.buffer, ctx.handle = buffer, d.handle
        ctx.save_for_backward(d.topk_idx)
        if d.topk_idx is not None:
            ctx.mark_non_differentiable(d.topk_idx)
        return d.x, d.topk_idx, d.topk_weights, d.num_recv_tokens_per_expert, d.handle, d.event

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor, _idx: Any, grad_w: torch.Tensor | None,
                 *_rest: Any) -> tuple[Any, ...]:
        (recv_idx,) = ctx.saved_tensors
        need_w = ctx.needs_input_grad[1] and grad_w is not None
        grad_x, grad_w = dispatch_adjoint(ctx.buffer, ctx.handle, grad_x, grad_w if need_w else None, recv_idx)
        return grad_x if ctx.needs_input_grad[0] else None, grad_w, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, topk_weights: torch.Tensor | None, buffer: Any, handle: Any,
                kwargs: dict[str, Any]) -> tuple[Any, ...]:
        c = buffer.combine(y, handle, topk_weights=topk_weights, **kwargs)
        ctx.buffer, ctx.handle = buffer, handle
        return c.x, c.topk_weights, c.event

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_w: torch.Tensor | None, _event: Any) -> tuple[Any, ...]:
        need_w = ctx.needs_input_grad[1] and grad_w is not None
        grad_y, grad_recv_w = combine_adjoint(ctx.buffer, ctx.handle, grad_out, grad_w if need_w else None)
        return grad_y if ctx.needs_input_grad[0] else None, grad_recv_w, None, None, None


class _LowLatencyDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, buffer: Any, topk_idx: torch.Tensor, num_max: int, num_experts: int,
                kwargs: dict[str, Any]) -> tuple[Any, ...]:
        r = buffer.low_latency_dispatch(x, topk_idx, num_max, num_experts, **kwargs)
        ctx.buffer, ctx.handle = buffer, r.handle
        ctx.save_for_backward(topk_idx)
        ctx.mark_non_differentiable(r.recv_count)
        return r.x, r.recv_count, r.handle, r.event

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor, *_rest: Any) -> tuple[Any, ...]:
        (topk_idx,) = ctx.saved_tensors
        return ll_dispatch_adjoint(ctx.buffer, ctx.handle, topk_idx, grad_x), None, None, None, None, None


class _LowLatencyCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, topk_weights: torch.Tensor, buffer: Any, topk_idx: torch.Tensor,
                handle: LowLatencyHandle) -> tuple[Any, ...]:
        c = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.save_for_backward(y, topk_idx, topk_weights)
        return c.x, c.event

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _event: Any) -> tuple[Any, ...]:
        y, topk_idx, topk_weights = ctx.saved_tensors
        grad_y, grad_w = ll_combine_adjoint(ctx.buffer, ctx.handle, topk_idx, topk_weights, y, grad_out,
                                            ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_y, grad_w, None, None, None


# ------------------------------------------------------------------------------------------------ public calls


def dispatch(buffer: Any, x: Any, topk_idx: Any = None, topk_weights: Any = None, num_experts: int | None = None,
             **kwargs: Any) -> DispatchResult:
    """``buffer.dispatch`` whose backward combines the gradients of the received x (and of the received weights)
    back to their tokens. Takes dispatch's other arguments (layout, handle, num_worst_tokens, config, ...) except
    ``async_finish``. FP8 x (a pair) has no gradient: it is refused when it requires one."""
    _check_kwargs(kwargs, "dispatch", ("async_finish",))
    if isinstance(x, (tuple, list)):
        if _needs_grad(*x):
            raise ArgumentError(with_rank("epjit.autograd.dispatch: FP8 x has no gradient (dispatch it from a tensor "
                                          "that does not require grad, or dispatch bf16)"))
        return buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts, **kwargs)
    if not _needs_grad(x, topk_weights):
        return buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts, **kwargs)
    recv_x, recv_idx, recv_w, counts, handle, event = _Dispatch.apply(
        x, topk_weights, buffer, topk_idx, {"num_experts": num_experts, **kwargs})
    return DispatchResult(recv_x, None, recv_idx, recv_w, counts, handle, event)


def combine(buffer: Any, y: torch.Tensor, handle: Any, topk_weights: torch.Tensor | None = None,
            **kwargs: Any) -> CombineResult:
    """``buffer.combine`` whose backward dispatches grad_out along the handle's routing (a handle replay; a worst-token
    handle's replay waits for its row count). Takes combine's bias and config, not ``async_finish`` or
    ``previous_event``; bias gets no gradient (add it outside to train it)."""
    _check_kwargs(kwargs, "combine", ("async_finish", "previous_event"))
    if _needs_grad(kwargs.get("bias")):
        raise ArgumentError(with_rank("epjit.autograd.combine: bias has no gradient here; add it to the result "
                                      "instead"))
    if not _needs_grad(y, topk_weights):
        return buffer.combine(y, handle, topk_weights=topk_weights, **kwargs)
    return CombineResult(*_Combine.apply(y, topk_weights, buffer, handle, kwargs))


def low_latency_dispatch(buffer: Any, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                         num_experts: int, use_fp8: bool = True, **kwargs: Any) -> LowLatencyDispatchResult:
    """``buffer.low_latency_dispatch`` whose backward sums each token's rows' gradients (a low_latency_combine with
    weight 1). A gradient needs ``use_fp8=False``; ``return_recv_hook`` and ``async_finish`` are refused."""
    _check_kwargs(kwargs, "low_latency_dispatch", ("return_recv_hook", "async_finish"))
    if not _needs_grad(x):
        return buffer.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                           use_fp8=use_fp8, **kwargs)
    if use_fp8:
        raise ArgumentError(with_rank("epjit.autograd.low_latency_dispatch: FP8 rows have no gradient; x requires "
                                      "grad, so pass use_fp8=False"))
    x_out, _count, handle, event = _LowLatencyDispatch.apply(
        x, buffer, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, {"use_fp8": False, **kwargs})
    return LowLatencyDispatchResult(x_out, None, handle, event, None)


def low_latency_combine(buffer: Any, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        handle: LowLatencyHandle, **kwargs: Any) -> LowLatencyCombineResult:
    """``buffer.low_latency_combine`` with gradients for y and topk_weights (docs/torch.md: their cost and
    precision). ``zero_copy``, ``out``, ``return_recv_hook`` and ``async_finish`` are refused."""
    _check_kwargs(kwargs, "low_latency_combine", ("zero_copy", "out", "return_recv_hook", "async_finish"))
    if not _needs_grad(y, topk_weights):
        return buffer.low_latency_combine(y, topk_idx, topk_weights, handle, **kwargs)
    _check_ll_sizes(handle.hidden, topk_idx.shape[1], y.requires_grad)
    out, event = _LowLatencyCombine.apply(y, topk_weights, buffer, topk_idx, handle)
    return LowLatencyCombineResult(out, event, None)


def _check_ll_sizes(hidden: int, num_topk: int, need_y: bool) -> None:
    """y's gradient carries the float32 weights in a row (2K columns), the weights' gradient comes home in K."""
    need = 2 * num_topk if need_y else num_topk
    if hidden < need:
        raise ArgumentError(with_rank(f"epjit.autograd.low_latency_combine: gradients at top-{num_topk} need "
                                      f"hidden >= {need}, got {hidden}"))


# ------------------------------------------------------------------------------------------------ custom ops
#
# The ops take a registered Buffer's id. Their fake implementations give the output shapes from the arguments and
# the Buffer's sizes, so torch.compile traces a layer through them without running a kernel. A low-latency handle
# crosses the graph as its metadata tensor (src_info, topk_slot, layout_range, recv_count: one int32 allocation) and
# is rebuilt from it; a normal-mode handle holds more than tensors, so it stays in a table, named by an int64 CPU
# tensor that keeps the entry alive as long as the graph holds it.

_EMPTY_SCALES = (0,)  # x_scales of a bf16 low-latency dispatch: custom ops return tensors, not None


def _ll_sizes(buffer: Any) -> tuple[int, int, int, int]:
    """Local experts, rows an expert, hidden and ranks of a low-latency Buffer."""
    r = buffer.num_ranks
    return buffer.num_experts // r, r * buffer.num_max_dispatch_tokens_per_rank, buffer.hidden, r


def _ll_handle(buffer: Any, meta: torch.Tensor, num_topk: int) -> LowLatencyHandle:
    """A low-latency handle rebuilt from the metadata tensor of its dispatch (what ll_dispatch returned)."""
    local, rows, _hidden, ranks = _ll_sizes(buffer)
    offsets = meta_offsets(local, rows, ranks)
    if meta.dtype != torch.int32 or tuple(meta.shape) != (offsets[-1],):
        raise ArgumentError(with_rank(f"meta must be the int32 [{offsets[-1]}] tensor ll_dispatch returned, got "
                                      f"{meta.dtype} {list(meta.shape)}"))
    return LowLatencyHandle(buffer.num_max_dispatch_tokens_per_rank, buffer.hidden, buffer.num_experts, num_topk,
                            _Meta(meta, "torch", meta.data_ptr(), offsets, (local, rows, ranks)), id(buffer), [False])


@torch.library.custom_op("epjit::ll_dispatch", mutates_args=())
def _ll_dispatch_op(buffer_id: int, x: torch.Tensor, topk_idx: torch.Tensor, use_fp8: bool, round_scale: bool,
                    use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    buffer = lookup(buffer_id)
    r = buffer.low_latency_dispatch(x, topk_idx, buffer.num_max_dispatch_tokens_per_rank, buffer.num_experts,
                                    use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
    scales = r.x_scales if r.x_scales is not None else x.new_empty(_EMPTY_SCALES, dtype=torch.float32)
    return r.x, scales, r.recv_count.clone(), r.handle.meta.owner


@_ll_dispatch_op.register_fake
def _(buffer_id: int, x: torch.Tensor, topk_idx: torch.Tensor, use_fp8: bool, round_scale: bool,
      use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    local, rows, hidden, ranks = _ll_sizes(lookup(buffer_id))
    if use_fp8:
        recv = x.new_empty((local, rows, hidden), dtype=torch.float8_e4m3fn)
        scales = x.new_empty((local, rows, hidden // 128), dtype=torch.uint8 if use_ue8m0 else torch.float32)
    else:
        recv, scales = x.new_empty((local, rows, hidden)), x.new_empty(_EMPTY_SCALES, dtype=torch.float32)
    meta = x.new_empty((meta_offsets(local, rows, ranks)[-1],), dtype=torch.int32)
    return recv, scales, x.new_empty((local,), dtype=torch.int32), meta


@torch.library.custom_op("epjit::ll_combine", mutates_args=())
def _ll_combine_op(buffer_id: int, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   meta: torch.Tensor) -> torch.Tensor:
    buffer = lookup(buffer_id)
    return buffer.low_latency_combine(y, topk_idx, topk_weights, _ll_handle(buffer, meta, topk_idx.shape[1])).x


@_ll_combine_op.register_fake
def _(buffer_id: int, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
      meta: torch.Tensor) -> torch.Tensor:
    return y.new_empty((topk_idx.shape[0], y.shape[2]))


@torch.library.custom_op("epjit::ll_combine_backward", mutates_args=())
def _ll_combine_backward_op(buffer_id: int, grad_out: torch.Tensor, y: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, meta: torch.Tensor, need_y: bool,
                            need_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = lookup(buffer_id)
    grad_y, grad_w = ll_combine_adjoint(buffer, _ll_handle(buffer, meta, topk_idx.shape[1]), topk_idx, topk_weights,
                                        y, grad_out, need_y, need_weights)
    return (grad_y if grad_y is not None else y.new_empty((0,)),
            grad_w if grad_w is not None else topk_weights.new_empty((0,)))


@_ll_combine_backward_op.register_fake
def _(buffer_id: int, grad_out: torch.Tensor, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
      meta: torch.Tensor, need_y: bool, need_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(y) if need_y else y.new_empty((0,)),
            torch.empty_like(topk_weights) if need_weights else topk_weights.new_empty((0,)))


def _ll_dispatch_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    if inputs[3] and inputs[1].requires_grad:  # called only when an input requires grad, while tracing too
        raise ArgumentError(with_rank("epjit::ll_dispatch: FP8 rows have no gradient; x requires grad, so pass "
                                      "use_fp8=False"))
    ctx.buffer_id = inputs[0]
    ctx.save_for_backward(inputs[2], output[3])


def _ll_dispatch_backward(ctx: Any, grad_x: torch.Tensor, *_rest: Any) -> tuple[Any, ...]:
    topk_idx, meta = ctx.saved_tensors
    ones = (topk_idx >= 0).to(torch.float32)
    grad = torch.ops.epjit.ll_combine(ctx.buffer_id, grad_x.to(torch.bfloat16).contiguous(), topk_idx, ones, meta)
    return None, grad, None, None, None, None


def _ll_combine_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.buffer_id = inputs[0]
    ctx.save_for_backward(*inputs[1:])


def _ll_combine_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    y, topk_idx, topk_weights, meta = ctx.saved_tensors
    need_y, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[3]
    grad_y, grad_w = torch.ops.epjit.ll_combine_backward(ctx.buffer_id, grad_out.contiguous(), y, topk_idx,
                                                         topk_weights, meta, need_y, need_w)
    return None, grad_y if need_y else None, None, grad_w if need_w else None, None


torch.library.register_autograd("epjit::ll_dispatch", _ll_dispatch_backward, setup_context=_ll_dispatch_setup)
torch.library.register_autograd("epjit::ll_combine", _ll_combine_backward, setup_context=_ll_combine_setup)

_HANDLES: dict[int, Any] = {}  # normal-mode handles of the custom ops, by the id their handle tensor holds
_NEXT_HANDLE = itertools.count(1)


def _keep_handle(handle: Any) -> torch.Tensor:
    """An int64 [1] CPU tensor naming ``handle`` in the table; the entry goes when that tensor is freed."""
    key = next(_NEXT_HANDLE)
    _HANDLES[key] = handle
    named = torch.tensor([key], dtype=torch.int64)
    weakref.finalize(named, _HANDLES.pop, key, None)
    return named


def _handle_of(handle_id: torch.Tensor) -> Any:
    handle = _HANDLES.get(int(handle_id.reshape(-1)[0]))
    if handle is None:
        raise ArgumentError(with_rank("handle_id names no live dispatch handle: pass the tensor epjit::dispatch "
                                      "returned, while it is alive"))
    return handle


@torch.library.custom_op("epjit::dispatch", mutates_args=())
def _dispatch_op(buffer_id: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, num_worst_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    if num_worst_tokens <= 0:
        raise ArgumentError(with_rank(f"epjit::dispatch needs num_worst_tokens > 0 (its output shape), got "
                                      f"{num_worst_tokens}"))
    d = lookup(buffer_id).dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
                                   num_worst_tokens=num_worst_tokens)
    return d.x, d.topk_idx, d.topk_weights, _keep_handle(d.handle)


@_dispatch_op.register_fake
def _(buffer_id: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
      num_worst_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, k = num_worst_tokens, topk_idx.shape[1]
    return (x.new_empty((rows, x.shape[1])), topk_idx.new_empty((rows, k)), topk_weights.new_empty((rows, k)),
            torch.empty((1,), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("epjit::dispatch_backward", mutates_args=())
def _dispatch_backward_op(buffer_id: int, grad_x: torch.Tensor, grad_weights: torch.Tensor,
                          recv_topk_idx: torch.Tensor, handle_id: torch.Tensor,
                          num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    grad, grad_w = dispatch_adjoint(lookup(buffer_id), _handle_of(handle_id), grad_x, grad_weights, recv_topk_idx)
    assert grad_w is not None and grad.shape[0] == num_tokens
    return grad, grad_w


@_dispatch_backward_op.register_fake
def _(buffer_id: int, grad_x: torch.Tensor, grad_weights: torch.Tensor, recv_topk_idx: torch.Tensor,
      handle_id: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (grad_x.new_empty((num_tokens, grad_x.shape[1])),
            grad_weights.new_empty((num_tokens, grad_weights.shape[1])))


@torch.library.custom_op("epjit::combine", mutates_args=())
def _combine_op(buffer_id: int, y: torch.Tensor, handle_id: torch.Tensor, num_tokens: int) -> torch.Tensor:
    out = lookup(buffer_id).combine(y, _handle_of(handle_id)).x
    assert out.shape[0] == num_tokens
    return out


@_combine_op.register_fake
def _(buffer_id: int, y: torch.Tensor, handle_id: torch.Tensor, num_tokens: int) -> torch.Tensor:
    return y.new_empty((num_tokens, y.shape[1]))


@torch.library.custom_op("epjit::combine_backward", mutates_args=())
def _combine_backward_op(buffer_id: int, grad_out: torch.Tensor, handle_id: torch.Tensor,
                         num_rows: int) -> torch.Tensor:
    grad_y, _ = combine_adjoint(lookup(buffer_id), _handle_of(handle_id), grad_out, None)
    assert grad_y.shape[0] == num_rows
    return grad_y


@_combine_backward_op.register_fake
def _(buffer_id: int, grad_out: torch.Tensor, handle_id: torch.Tensor, num_rows: int) -> torch.Tensor:
    return grad_out.new_empty((num_rows, grad_out.shape[1]))


def _dispatch_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    ctx.buffer_id, ctx.num_tokens = inputs[0], inputs[1].shape[0]
    ctx.save_for_backward(output[1], output[3])


def _dispatch_backward(ctx: Any, grad_x: torch.Tensor, _idx: Any, grad_w: torch.Tensor, _handle: Any) -> tuple:
    recv_idx, handle_id = ctx.saved_tensors
    if grad_w is None:  # the received weights took no part in the loss
        grad_w = torch.zeros(recv_idx.shape, dtype=torch.float32, device=recv_idx.device)
    grad, grad_weights = torch.ops.epjit.dispatch_backward(ctx.buffer_id, grad_x.contiguous(), grad_w.contiguous(),
                                                           recv_idx, handle_id, ctx.num_tokens)
    return None, grad, None, grad_weights, None, None


def _combine_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.buffer_id, ctx.num_rows = inputs[0], inputs[1].shape[0]
    ctx.save_for_backward(inputs[2])


def _combine_backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    (handle_id,) = ctx.saved_tensors
    return None, torch.ops.epjit.combine_backward(ctx.buffer_id, grad_out.contiguous(), handle_id, ctx.num_rows), \
        None, None


torch.library.register_autograd("epjit::dispatch", _dispatch_backward, setup_context=_dispatch_setup)
torch.library.register_autograd("epjit::combine", _combine_backward, setup_context=_combine_setup)
