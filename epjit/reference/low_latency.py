"""Low-latency mode on simulated ranks: dispatch into per-expert receive buffers, combine from them, and the
reordering that makes a kernel's result comparable with the reference's."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import check_flag, check_int
from ._checks import (
    argument_error,
    check_bf16,
    check_hidden_fp8,
    check_num_experts,
    check_topk_idx,
    check_topk_weights,
    host_array,
    per_rank,
    poison_bf16,
    type_error,
)
from .numerics import LOGFMT_CHANNELS, logfmt_cast_back, per_token_cast_to_fp8
from .results import (
    BF16,
    FP8_BLOCK,
    POISON_FP8_BITS,
    POISON_SCALE,
    POISON_SRC_INFO,
    POISON_UE8M0,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)


def pack_layout_range(begin: np.ndarray | int, count: np.ndarray | int) -> np.ndarray:
    """``begin << 32 | count`` as int64 (the layout_range encoding)."""
    parts = []
    for name, value in (("begin", begin), ("count", count)):
        part = host_array(value)
        if not np.issubdtype(part.dtype, np.integer):  # np.asarray(3.7 or "3", dtype=np.int64) would take it
            shown = repr(value) if part.ndim == 0 else f"an array of {part.dtype}"
            raise type_error(f"{name} must be an int or an integer array, got {shown}")
        parts.append(part.astype(np.int64))
    return (parts[0] << 32) | parts[1]


def unpack_layout_range(layout_range: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(begin, count)`` of each ``layout_range`` entry, as int64 arrays."""
    packed = np.asarray(host_array(layout_range), dtype=np.int64)
    return packed >> 32, packed & 0xFFFFFFFF


def _slots_by_expert(topk_idx: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group one rank's top-k slots by expert: slots naming expert ``g`` are ``[offsets[g], offsets[g+1])`` of
    ``(tokens, ks)``, ordered by token then k (so a repeated expert gives the same token twice, in k order)."""
    flat = topk_idx.ravel()
    order = np.argsort(flat, kind="stable")  # stable: keeps row-major (token, k) order within each expert
    order = order[flat[order] >= 0]
    offsets = np.zeros(num_experts + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(np.bincount(flat[flat >= 0], minlength=num_experts))
    num_topk = max(topk_idx.shape[1], 1)
    return order // num_topk, order % num_topk, offsets


def _check_low_latency_inputs(
    xs: Sequence[Any], topk_idx: Sequence[Any], max_tokens: int, num_experts: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Every rank's bf16 tokens (at most ``max_tokens``, rank 0's hidden size) and int64 ``topk_idx``."""
    xs_in: list[np.ndarray] = []
    idx_in: list[np.ndarray] = []
    for r in range(len(xs)):
        x = check_bf16(xs[r], f"xs[{r}]", 2)
        if r > 0 and x.shape[1] != xs_in[0].shape[1]:
            raise argument_error(f"xs[{r}] has hidden={x.shape[1]} but xs[0] has hidden={xs_in[0].shape[1]}")
        if x.shape[0] > max_tokens:
            raise argument_error(f"xs[{r}] has {x.shape[0]} tokens but num_max_dispatch_tokens_per_rank={max_tokens}")
        xs_in.append(x)
        num_topk = idx_in[0].shape[1] if r > 0 else None
        idx_in.append(check_topk_idx(topk_idx[r], f"topk_idx[{r}]", x.shape[0], num_topk, num_experts))
    return xs_in, idx_in


def _low_latency_payload(
    xs: list[np.ndarray], use_fp8: bool, round_scale: bool, use_ue8m0: bool
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """What goes on the wire from each rank: ``(data, scales)``, quantised once per source, not once per message."""
    if not use_fp8:
        return [(x, None) for x in xs]
    return [per_token_cast_to_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0) for x in xs]


def _poisoned_receive_buffers(
    num_local: int, num_rows: int, hidden: int, use_fp8: bool, use_ue8m0: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """One rank's ``x``/``x_scales`` receive buffers, filled with poison so that rows nobody writes read as NaN."""
    if not use_fp8:
        return poison_bf16((num_local, num_rows, hidden)), None
    x = np.full((num_local, num_rows, hidden), POISON_FP8_BITS, dtype=np.uint8)
    scales_shape = (num_local, num_rows, hidden // FP8_BLOCK)
    if use_ue8m0:
        return x, np.full(scales_shape, POISON_UE8M0, dtype=np.uint8)
    return x, np.full(scales_shape, POISON_SCALE, dtype=np.float32)


def _low_latency_dispatch_to_rank(
    rank: int,
    payload: list[tuple[np.ndarray, np.ndarray | None]],
    slots: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    *,
    max_tokens: int,
    num_experts: int,
    hidden: int,
    use_fp8: bool,
    use_ue8m0: bool,
    masked: frozenset[int] = frozenset(),
) -> LowLatencyDispatchResult:
    """What rank ``rank`` receives: for each local expert, the source blocks in rank order (``slots[s]`` is
    :func:`_slots_by_expert` of rank ``s``); a masked source's blocks are empty."""
    num_ranks = len(payload)
    num_local = num_experts // num_ranks
    num_rows = num_ranks * max_tokens
    x_out, scales_out = _poisoned_receive_buffers(num_local, num_rows, hidden, use_fp8, use_ue8m0)
    src_info = np.full((num_local, num_rows), POISON_SRC_INFO, dtype=np.int32)
    layout_range = np.zeros((num_local, num_ranks), dtype=np.int64)
    recv_count = np.zeros(num_local, dtype=np.int32)

    for e in range(num_local):
        expert = rank * num_local + e
        begin = 0
        for s in range(num_ranks):
            tokens_by_expert, _, offsets = slots[s]
            tokens = tokens_by_expert[offsets[expert] : offsets[expert + 1]]
            if s in masked:
                tokens = tokens[:0]
            # Each (expert, source) receive slot has room for max_tokens rows; only repeated experts overflow it.
            if len(tokens) > max_tokens:
                raise argument_error(
                    f"topk_idx[{s}] sends {len(tokens)} slots to expert {expert} (repeated experts) "
                    f"but num_max_dispatch_tokens_per_rank={max_tokens}"
                )
            rows = slice(begin, begin + len(tokens))
            data, scales = payload[s]
            x_out[e, rows] = data[tokens]
            if scales_out is not None and scales is not None:
                scales_out[e, rows] = scales[tokens]
            src_info[e, rows] = tokens
            layout_range[e, s] = pack_layout_range(begin, len(tokens))
            begin += len(tokens)
        recv_count[e] = begin

    handle = LowLatencyHandle(
        src_info=src_info,
        layout_range=layout_range,
        num_max_dispatch_tokens_per_rank=max_tokens,
        hidden=int(hidden),
        num_experts=int(num_experts),
    )
    return LowLatencyDispatchResult(x=x_out, x_scales=scales_out, recv_count=recv_count, handle=handle)


def low_latency_dispatch(
    xs: Sequence[np.ndarray],
    topk_idx: Sequence[np.ndarray],
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    *,
    use_fp8: bool = True,
    round_scale: bool = False,
    use_ue8m0: bool = False,
    masked_ranks: Iterable[int] = (),
) -> list[LowLatencyDispatchResult | None]:
    """Low-latency dispatch over ``len(xs)`` simulated ranks; ``xs[r]`` is ``[N_r, H]`` bf16, ``N_r <= max``.

    One message per valid top-k slot ``(t, k)`` (as DeepEP: a token naming an expert twice arrives twice). On rank
    ``r``, for local expert ``e`` (global ``r*L + e``), the rows are the source blocks in rank order (kernels may
    order the blocks, and the rows inside a block, differently; :func:`sort_low_latency_result` puts a result in
    the reference order), each block holding that source's tokens ascending. Per rank:

    - ``x [L, R*max, H]``: the token (FP8 bits from :func:`per_token_cast_to_fp8` of the source row with
      ``round_scale``/``use_ue8m0``, or bf16); ``x_scales [L, R*max, H/128]`` float32 (uint8 e8m0 with use_ue8m0);
    - ``recv_count[e]`` rows are valid; rows past it hold poison (``POISON_*``: NaN data, NaN scales, 0xFF e8m0
      bytes, ``src_info`` = INT32_MIN) to catch readers of garbage;
    - ``handle.src_info[e, row]``: source token index; ``handle.layout_range[e, src] = begin << 32 | count``
      (an empty block has count 0 and begin where it would start).

    A source rank with more than ``max`` tokens, or (only possible with repeated experts) more than ``max`` slots
    for one expert, is an ArgumentError: each (expert, source) receive slot has room for ``max`` rows.

    ``masked_ranks`` (shrink mode, as DeepEP): those ranks take no part. Nothing arrives from a masked source (its
    blocks are empty: count 0, recv_count without them), and a masked rank's own result is None (what a masked,
    perhaps dead, rank holds is not defined); its ``xs``/``topk_idx`` entries are not read and may be None.
    """
    num_ranks = len(per_rank("xs", xs))
    num_experts = check_num_experts(num_experts, num_ranks)[0]
    masked = _masked_ranks(masked_ranks, num_ranks)
    if masked:  # a masked rank's inputs are not read: stand-ins of a live rank's, whose blocks are then left out
        live = next((r for r in range(num_ranks) if r not in masked), None)
        if live is None:
            raise argument_error(f"masked_ranks={sorted(masked)} masks every one of the {num_ranks} ranks")
        xs = [xs[live] if r in masked else xs[r] for r in range(num_ranks)]
        topk_idx = [topk_idx[live] if r in masked else topk_idx[r] for r in range(num_ranks)]
    topk_idx = per_rank("topk_idx", topk_idx, num_ranks)
    max_tokens = check_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", 1)
    use_fp8, round_scale, use_ue8m0 = (check_flag(v, n) for v, n in (
        (use_fp8, "use_fp8"), (round_scale, "round_scale"), (use_ue8m0, "use_ue8m0")))
    if not use_fp8 and (round_scale or use_ue8m0):
        raise argument_error(f"round_scale={round_scale} and use_ue8m0={use_ue8m0} need use_fp8=True")
    xs_in, idx_in = _check_low_latency_inputs(xs, topk_idx, max_tokens, num_experts)
    hidden = xs_in[0].shape[1]
    if use_fp8:
        check_hidden_fp8(hidden, "xs")

    payload = _low_latency_payload(xs_in, use_fp8, round_scale, use_ue8m0)
    slots = [_slots_by_expert(idx, num_experts) for idx in idx_in]
    return [
        _low_latency_dispatch_to_rank(
            r,
            payload,
            slots,
            max_tokens=max_tokens,
            num_experts=num_experts,
            hidden=hidden,
            use_fp8=use_fp8,
            use_ue8m0=use_ue8m0,
            masked=masked,
        )
        if r not in masked else None
        for r in range(num_ranks)
    ]


def _masked_ranks(masked_ranks: Iterable[int], num_ranks: int) -> frozenset[int]:
    """``masked_ranks`` as a set, each checked to be a rank."""
    try:
        ranks = [check_int(r, "masked_ranks") for r in masked_ranks]
    except TypeError:
        raise type_error(f"masked_ranks must be an iterable of ranks, got {type(masked_ranks).__name__}") from None
    bad = [r for r in ranks if r >= num_ranks]
    if bad:
        raise argument_error(f"masked_ranks has {bad} but there are {num_ranks} ranks")
    return frozenset(ranks)


def _check_ll_block(handle: LowLatencyHandle, name: str, e: int, s: int) -> np.ndarray:
    """Rows of rank ``r``'s local expert ``e`` that came from rank ``s``, checked to lie inside the buffer."""
    begin, count = (int(v) for v in unpack_layout_range(handle.layout_range[e, s]))
    capacity = handle.src_info.shape[1]
    if begin < 0 or begin + count > capacity:
        raise argument_error(
            f"{name}.layout_range[{e}, {s}] = (begin {begin}, count {count}) "
            f"lies outside the {capacity} rows of an expert"
        )
    return np.arange(begin, begin + count)


def low_latency_combine(
    ys: Sequence[np.ndarray],
    topk_idx: Sequence[np.ndarray],
    topk_weights: Sequence[np.ndarray],
    handles: Sequence[LowLatencyHandle],
    *,
    use_logfmt: bool = False,
    masked_ranks: Iterable[int] = (),
) -> list[LowLatencyCombineResult | None]:
    """Low-latency combine over simulated ranks; returns each home rank's result, whose ``x`` is ``[N, H]`` bf16.

    ``ys[r]`` is ``[L, R*max, H]`` bf16, the expert outputs in rank ``r``'s received layout (``handles[r]``; rows
    past each block are never read, so they may hold anything). ``topk_idx[s]``/``topk_weights[s]`` are home rank
    ``s``'s routing, as given to dispatch. For each token ``t``::

        x[t] = bf16( sum over k = 0..K-1 with topk_idx[t, k] >= 0 of float32(w[t, k]) * float32(y[row of (t, k)]) )

    accumulated in float32 in k order and cast once. The row of ``(t, k)`` is found from the handle alone (the
    block ``layout_range[e, s]`` and ``src_info``), so a handle from a kernel that orders rows differently works
    too. With a repeated expert, the j-th row of token ``t`` in its block (rows sorted stably by ``src_info``)
    answers the j-th slot of ``t`` naming that expert; the rows hold the same token, so any pairing gives the same
    sum for an expert that maps equal inputs to equal outputs.

    ``use_logfmt=True``: each row travels as DeepEP's LogFMT-10, so ``float32(y[row])`` above is its round trip
    :func:`~epjit.reference.numerics.logfmt_cast_back` (hidden % 128 == 0).

    ``masked_ranks`` (shrink mode, as DeepEP): the terms of experts on a masked rank are skipped (zero), and a masked
    rank's result is None; its ``ys``/``topk_idx``/``topk_weights``/``handles`` entries are not read and may be None.
    """
    use_logfmt = check_flag(use_logfmt, "use_logfmt")
    handles = per_rank("handles", handles)
    num_ranks = len(handles)
    masked = _masked_ranks(masked_ranks, num_ranks)
    if masked:
        return _combine_live(ys, topk_idx, topk_weights, handles, masked, use_logfmt)
    for r, h in enumerate(handles):
        if not isinstance(h, LowLatencyHandle):
            raise type_error(f"handles[{r}] must be a LowLatencyHandle, got {type(h).__name__}")
        if h.num_ranks != num_ranks:
            raise argument_error(f"handles[{r}] is for {h.num_ranks} ranks but {num_ranks} handles were given")
        if h.num_experts != handles[0].num_experts:
            raise argument_error(
                f"handles[{r}] has num_experts={h.num_experts} but handles[0] has {handles[0].num_experts}"
            )
    num_experts, num_local = check_num_experts(handles[0].num_experts, num_ranks)
    ys = per_rank("ys", ys, num_ranks)
    topk_idx = per_rank("topk_idx", topk_idx, num_ranks)
    topk_weights = per_rank("topk_weights", topk_weights, num_ranks)

    ys_in = [check_bf16(ys[r], f"ys[{r}]", 3) for r in range(num_ranks)]
    hidden = ys_in[0].shape[2]
    if use_logfmt and hidden % LOGFMT_CHANNELS:
        raise argument_error(f"use_logfmt=True needs hidden % {LOGFMT_CHANNELS} == 0, hidden={hidden}")
    for r in range(num_ranks):
        expected = (num_local, handles[r].src_info.shape[1], hidden)
        if ys_in[r].shape != expected:
            raise argument_error(f"ys[{r}] has shape {ys_in[r].shape} but handles[{r}] describes {expected}")
    idx_in: list[np.ndarray] = []
    weights_in: list[np.ndarray] = []
    for s in range(num_ranks):
        num_topk = idx_in[0].shape[1] if s > 0 else None
        idx_in.append(check_topk_idx(topk_idx[s], f"topk_idx[{s}]", None, num_topk, num_experts))
        weights_in.append(check_topk_weights(topk_weights[s], f"topk_weights[{s}]", idx_in[s].shape))

    if use_logfmt:  # (the round trip of every row, read or not: per 128 channels, so rows never mix)
        ys_in = [logfmt_cast_back(y) for y in ys_in]
    outputs: list[LowLatencyCombineResult] = []
    for s in range(num_ranks):
        idx = idx_in[s]
        tokens_by_expert, ks_by_expert, offsets = _slots_by_expert(idx, num_experts)

        # row_of[t, k]: the row, in its expert's received array, holding the answer to slot (t, k).
        row_of = np.full(idx.shape, -1, dtype=np.int64)
        for r in range(num_ranks):
            for e in range(num_local):
                expert = r * num_local + e
                rows = _check_ll_block(handles[r], f"handles[{r}]", e, s)
                order = np.argsort(handles[r].src_info[e, rows], kind="stable")
                rows, row_tokens = rows[order], handles[r].src_info[e, rows[order]]
                tokens = tokens_by_expert[offsets[expert] : offsets[expert + 1]]
                if not np.array_equal(row_tokens, tokens):
                    raise argument_error(
                        f"handles[{r}] holds tokens {row_tokens.tolist()[:8]} of rank {s} for expert {expert} "
                        f"but topk_idx[{s}] sends it tokens {tokens.tolist()[:8]}: the handle is from "
                        f"another routing"
                    )
                row_of[tokens, ks_by_expert[offsets[expert] : offsets[expert + 1]]] = rows

        acc = np.zeros((idx.shape[0], hidden), dtype=np.float32)
        for k in range(idx.shape[1]):
            tokens = np.flatnonzero(idx[:, k] >= 0)
            experts = idx[tokens, k]
            owners = experts // num_local
            y = np.empty((len(tokens), hidden), dtype=np.float32)
            for r in range(num_ranks):
                mine = owners == r
                y[mine] = ys_in[r][experts[mine] - r * num_local, row_of[tokens[mine], k]]
            acc[tokens] += y * weights_in[s][tokens, k][:, None]
        outputs.append(LowLatencyCombineResult(x=acc.astype(BF16)))
    return outputs


def _combine_live(ys: Sequence[Any], topk_idx: Sequence[Any], topk_weights: Sequence[Any], handles: Sequence[Any],
                  masked: frozenset[int], use_logfmt: bool) -> list[LowLatencyCombineResult | None]:
    """low_latency_combine with ``masked`` ranks out: each live home's top-k entries on a masked rank become -1
    (skipped), and a masked rank stands in as a rank that received nothing and sends nothing home."""
    num_ranks = len(handles)
    live = [r for r in range(num_ranks) if r not in masked]
    if not live:
        raise argument_error(f"masked_ranks={sorted(masked)} masks every one of the {num_ranks} ranks")
    model = handles[live[0]]
    if not isinstance(model, LowLatencyHandle):
        raise type_error(f"handles[{live[0]}] must be a LowLatencyHandle, got {type(model).__name__}")
    num_local = model.num_experts // num_ranks
    empty = LowLatencyHandle(src_info=np.zeros_like(model.src_info), layout_range=np.zeros_like(model.layout_range),
                             num_max_dispatch_tokens_per_rank=model.num_max_dispatch_tokens_per_rank,
                             hidden=model.hidden, num_experts=model.num_experts)
    owner_masked = np.array([e // num_local in masked for e in range(model.num_experts)])
    idx_live, weights_live, ys_live, handles_live = [], [], [], []
    for r in range(num_ranks):
        if r in masked:
            k = np.asarray(topk_idx[live[0]]).shape[1]
            idx_live.append(np.full((0, k), -1, dtype=np.int64))
            weights_live.append(np.zeros((0, k), dtype=np.float32))
            ys_live.append(np.zeros(ys[live[0]].shape, dtype=BF16))
            handles_live.append(empty)
            continue
        idx = check_topk_idx(topk_idx[r], f"topk_idx[{r}]", None, None, model.num_experts).copy()
        idx[(idx >= 0) & owner_masked[np.maximum(idx, 0)]] = -1
        idx_live.append(idx)
        weights_live.append(topk_weights[r])
        ys_live.append(ys[r])
        # A source masked after the dispatch (DeepEP: a combine's wait timed out) sends nothing home: its blocks go.
        begin, count = unpack_layout_range(handles[r].layout_range)
        count[:, sorted(masked)] = 0
        handles_live.append(LowLatencyHandle(
            src_info=handles[r].src_info, layout_range=pack_layout_range(begin, count),
            num_max_dispatch_tokens_per_rank=model.num_max_dispatch_tokens_per_rank, hidden=model.hidden,
            num_experts=model.num_experts))
    results = low_latency_combine(ys_live, idx_live, weights_live, handles_live, use_logfmt=use_logfmt)
    return [None if r in masked else results[r] for r in range(num_ranks)]


def sort_low_latency_result(result: LowLatencyDispatchResult) -> LowLatencyDispatchResult:
    """Reorder a low-latency result (e.g. a GPU one, its arrays copied into this record) into the reference order,
    to compare it with ``==``.

    For each local expert, the source blocks are laid out in rank order and the rows inside each block sorted
    stably by source token; ``src_info``/``layout_range`` follow, and rows past ``recv_count`` are re-poisoned.
    """
    handle = result.handle
    num_local, num_ranks = handle.layout_range.shape
    x = np.array(result.x, copy=True)
    scales = None if result.x_scales is None else np.array(result.x_scales, copy=True)
    src_info = np.full_like(handle.src_info, POISON_SRC_INFO)
    layout_range = np.zeros_like(handle.layout_range)
    for e in range(num_local):
        gathered = []
        begin = 0
        for s in range(num_ranks):
            rows = _check_ll_block(handle, "result.handle", e, s)
            rows = rows[np.argsort(handle.src_info[e, rows], kind="stable")]
            gathered.append(rows)
            layout_range[e, s] = pack_layout_range(begin, len(rows))
            begin += len(rows)
        rows = np.concatenate(gathered)
        if begin != int(result.recv_count[e]):
            raise argument_error(
                f"layout_range of expert {e} covers {begin} rows but recv_count[{e}]={result.recv_count[e]}"
            )
        x[e, :begin] = result.x[e, rows]
        src_info[e, :begin] = handle.src_info[e, rows]
        if x.dtype == np.uint8:
            x[e, begin:] = POISON_FP8_BITS
        else:
            x[e, begin:] = poison_bf16(x[e, begin:].shape)
        if scales is not None and result.x_scales is not None:
            scales[e, :begin] = result.x_scales[e, rows]
            scales[e, begin:] = POISON_UE8M0 if scales.dtype == np.uint8 else POISON_SCALE
    new_handle = LowLatencyHandle(
        src_info=src_info,
        layout_range=layout_range,
        num_max_dispatch_tokens_per_rank=handle.num_max_dispatch_tokens_per_rank,
        hidden=handle.hidden,
        num_experts=handle.num_experts,
    )
    return LowLatencyDispatchResult(x=x, x_scales=scales, recv_count=result.recv_count.copy(), handle=new_handle)
