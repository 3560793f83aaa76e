"""Normal mode on simulated ranks: the layout, dispatch and combine (one NVLink node or several)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import check_flag, check_int
from ._checks import (
    align_up,
    argument_error,
    check_bf16,
    check_fp8_bits,
    check_hidden_fp8,
    check_num_experts,
    check_num_nvl_ranks,
    check_topk_idx,
    check_topk_weights,
    host_array,
    is_float_dtype,
    per_rank,
    type_error,
)
from .low_latency import _masked_ranks
from .numerics import fp8_round_trip
from .results import BF16, FP8, FP8_BLOCK, Bias, CombineResult, DispatchHandle, DispatchResult, Layout


def rank_of_expert(expert: int, num_experts: int, num_ranks: int) -> int:
    """The rank that owns global expert ``expert``: rank ``r`` owns ``[r*E/R, (r+1)*E/R)``."""
    num_experts, num_local = check_num_experts(num_experts, num_ranks)
    expert = check_int(expert, "expert", None)
    if not 0 <= expert < num_experts:
        raise argument_error(f"expert={expert} must lie in [0, {num_experts}) (num_experts)")
    return expert // num_local


def get_dispatch_layout(
    topk_idx: np.ndarray, num_experts: int, num_ranks: int, num_nvl_ranks: int | None = None
) -> Layout:
    """Count where ONE rank's tokens go (its ``topk_idx`` is ``[N, K]``, -1 = no expert).

    - ``is_token_in_rank[t, r]``: token ``t`` has at least one expert on rank ``r``.
    - ``num_tokens_per_rank[r]``: tokens sent to rank ``r`` (each token once, however many of its experts live there).
    - ``num_tokens_per_rdma_rank[n]``: tokens sent to node ``n`` (ranks ``[n*num_nvl_ranks, (n+1)*num_nvl_ranks)``),
      each token once per node; ``None`` when ``num_nvl_ranks`` is None or equals ``num_ranks`` (one node).
    - ``num_tokens_per_expert[e]``: top-k slots naming expert ``e``. A token listing ``e`` twice counts twice (the
      DeepEP layout kernel counts slots, and so does the received ``num_recv_tokens_per_expert``).
    """
    num_experts, num_local = check_num_experts(num_experts, num_ranks)
    num_ranks = int(num_ranks)
    num_nvl_ranks = check_num_nvl_ranks(num_nvl_ranks, num_ranks)
    idx = check_topk_idx(topk_idx, "topk_idx", None, None, num_experts)
    num_tokens = idx.shape[0]

    valid = idx >= 0
    tokens, slots = np.nonzero(valid)
    is_token_in_rank = np.zeros((num_tokens, num_ranks), dtype=bool)
    is_token_in_rank[tokens, idx[tokens, slots] // num_local] = True

    num_tokens_per_rdma_rank = None
    if num_nvl_ranks is not None:
        num_nodes = num_ranks // num_nvl_ranks
        is_token_in_node = is_token_in_rank.reshape(num_tokens, num_nodes, num_nvl_ranks).any(axis=2)
        num_tokens_per_rdma_rank = is_token_in_node.sum(axis=0).astype(np.int32)

    return Layout(
        num_tokens_per_rank=is_token_in_rank.sum(axis=0).astype(np.int32),
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        num_tokens_per_expert=np.bincount(idx[valid], minlength=num_experts).astype(np.int32),
        is_token_in_rank=is_token_in_rank,
    )


@dataclass(frozen=True, eq=False)
class _DispatchInputs:
    """Every rank's dispatch inputs, validated and in canonical dtypes (FP8 as uint8 bits, indices int64)."""

    xs: list[np.ndarray]  # [N_r, H] bf16 or uint8 FP8 bits
    topk_idx: list[np.ndarray]  # [N_r, K] int64, global expert ids
    topk_weights: list[np.ndarray] | None  # [N_r, K] float32
    x_scales: list[np.ndarray] | None  # [N_r, H/128] float32, present exactly with FP8

    @property
    def hidden(self) -> int:
        return int(self.xs[0].shape[1])

    @property
    def num_topk(self) -> int:
        return int(self.topk_idx[0].shape[1])


@dataclass(frozen=True, eq=False)
class _NormalRouting:
    """Who sends which tokens to whom in normal mode, derived from every rank's layout."""

    sent_tokens: list[list[np.ndarray]]  # [src][dst]: the token indices that src sends to dst, ascending
    counts: np.ndarray  # [src, dst] int32: len(sent_tokens[src][dst])
    rank_prefix_matrix: np.ndarray  # [R, R] int32: counts summed over src = 0..i
    is_token_in_rank: list[np.ndarray]  # [src]: that rank's [N_src, R] routing as a sender


def _check_dispatch_x(x: Any, name: str, use_fp8: bool) -> np.ndarray:
    """One rank's dispatch tokens: FP8 bits when scales were given, bf16 otherwise, always 2-D."""
    if use_fp8:
        bits = check_fp8_bits(x, name)
        if bits.ndim != 2:
            raise argument_error(f"{name} must be 2-D [num_tokens, hidden], got shape {bits.shape}")
        return bits
    arr = host_array(x)
    # FP8 data without scales cannot be dequantised by the receiver, so name the missing argument.
    if arr.dtype in (np.uint8, FP8):
        raise type_error(f"{name} is FP8 ({arr.dtype}) but x_scales is None: pass the float32 scales")
    return check_bf16(arr, name, 2)


def _check_dispatch_scales(scales: list[Any], xs: list[np.ndarray]) -> list[np.ndarray]:
    """Every rank's FP8 scales: float32, one per token and block of 128 channels."""
    hidden = xs[0].shape[1]
    check_hidden_fp8(hidden, "xs")
    checked: list[np.ndarray] = []
    for r, scale in enumerate(scales):
        s = host_array(scale)
        if s.dtype != np.float32:
            raise type_error(f"x_scales[{r}] must be float32, got {s.dtype}")
        if s.shape != (xs[r].shape[0], hidden // FP8_BLOCK):
            raise argument_error(
                f"x_scales[{r}] has shape {s.shape} but must be {(xs[r].shape[0], hidden // FP8_BLOCK)}"
            )
        checked.append(s)
    return checked


def _check_dispatch_inputs(
    xs: Sequence[Any],
    topk_idx: Sequence[Any],
    topk_weights: Sequence[np.ndarray] | None,
    x_scales: Sequence[np.ndarray] | None,
    num_experts: int,
) -> _DispatchInputs:
    """Validate every rank's dispatch inputs against rank 0's hidden size and num_topk, and canonicalise them."""
    num_ranks = len(xs)
    use_fp8 = x_scales is not None
    scales_list = per_rank("x_scales", x_scales, num_ranks) if use_fp8 else None
    weights_list = per_rank("topk_weights", topk_weights, num_ranks) if topk_weights is not None else None
    xs_in: list[np.ndarray] = []
    idx_in: list[np.ndarray] = []
    weights_in: list[np.ndarray] | None = [] if weights_list is not None else None
    for r in range(num_ranks):
        x = _check_dispatch_x(xs[r], f"xs[{r}]", use_fp8)
        if r > 0 and x.shape[1] != xs_in[0].shape[1]:
            raise argument_error(f"xs[{r}] has hidden={x.shape[1]} but xs[0] has hidden={xs_in[0].shape[1]}")
        xs_in.append(x)
        num_topk = idx_in[0].shape[1] if r > 0 else None
        idx_in.append(check_topk_idx(topk_idx[r], f"topk_idx[{r}]", x.shape[0], num_topk, num_experts))
        if weights_list is not None and weights_in is not None:
            weights_in.append(check_topk_weights(weights_list[r], f"topk_weights[{r}]", idx_in[r].shape))
    scales_in = _check_dispatch_scales(scales_list, xs_in) if scales_list is not None else None
    return _DispatchInputs(xs=xs_in, topk_idx=idx_in, topk_weights=weights_in, x_scales=scales_in)


def _route_normal(topk_idx: list[np.ndarray], num_experts: int) -> _NormalRouting:
    """Derive who sends what to whom from every rank's (validated) ``topk_idx``."""
    num_ranks = len(topk_idx)
    layouts = [get_dispatch_layout(idx, num_experts, num_ranks) for idx in topk_idx]
    counts = np.array([layout.num_tokens_per_rank for layout in layouts], dtype=np.int32)
    return _NormalRouting(
        sent_tokens=[[np.flatnonzero(layout.is_token_in_rank[:, r]) for r in range(num_ranks)] for layout in layouts],
        counts=counts,
        rank_prefix_matrix=np.cumsum(counts, axis=0, dtype=np.int32),
        is_token_in_rank=[layout.is_token_in_rank for layout in layouts],
    )


def _dispatch_to_rank(
    inputs: _DispatchInputs,
    routing: _NormalRouting,
    rank: int,
    num_rows: int,
    num_local: int,
    expert_alignment: int,
) -> DispatchResult:
    """What rank ``rank`` receives: the senders' rows in source-rank order, then padding up to ``num_rows``."""
    num_recv = int(routing.counts[:, rank].sum())
    hidden, num_topk = inputs.hidden, inputs.num_topk
    # Padding rows keep these fills: zeros in x/x_scales/weights and -1 in topk_idx, as documented in dispatch.
    x_out = np.zeros((num_rows, hidden), dtype=inputs.xs[0].dtype)
    scales_out = np.zeros((num_rows, hidden // FP8_BLOCK), dtype=np.float32) if inputs.x_scales is not None else None
    global_idx = np.full((num_rows, num_topk), -1, dtype=np.int64)
    weights_out = np.zeros((num_rows, num_topk), dtype=np.float32) if inputs.topk_weights is not None else None
    src_rank = np.zeros(num_recv, dtype=np.int32)
    src_token = np.zeros(num_recv, dtype=np.int32)

    begin = 0
    for s in range(len(inputs.xs)):
        tokens = routing.sent_tokens[s][rank]
        rows = slice(begin, begin + len(tokens))
        x_out[rows] = inputs.xs[s][tokens]
        if scales_out is not None and inputs.x_scales is not None:
            scales_out[rows] = inputs.x_scales[s][tokens]
        global_idx[rows] = inputs.topk_idx[s][tokens]
        if weights_out is not None and inputs.topk_weights is not None:
            weights_out[rows] = inputs.topk_weights[s][tokens]
        src_rank[rows] = s
        src_token[rows] = tokens
        begin += len(tokens)

    # Keep only this rank's experts, renumbered locally; the other slots become -1 / weight 0.
    is_local = (global_idx >= rank * num_local) & (global_idx < (rank + 1) * num_local)
    local_idx = np.where(is_local, global_idx - rank * num_local, -1)
    if weights_out is not None:
        weights_out = np.where(is_local, weights_out, np.float32(0))
    per_expert = np.bincount(local_idx[is_local], minlength=num_local)
    return DispatchResult(
        x=x_out,
        x_scales=scales_out,
        topk_idx=local_idx,
        topk_weights=weights_out,
        num_recv_tokens_per_expert=[align_up(int(c), expert_alignment) for c in per_expert],
        handle=DispatchHandle(
            src_rank=src_rank,
            src_token=src_token,
            num_recv_tokens=num_recv,
            num_rows=num_rows,
            is_token_in_rank=routing.is_token_in_rank[rank],
            rank_prefix_matrix=routing.rank_prefix_matrix,
        ),
    )


def dispatch(
    xs: Sequence[np.ndarray],
    topk_idx: Sequence[np.ndarray],
    topk_weights: Sequence[np.ndarray] | None,
    num_experts: int,
    *,
    x_scales: Sequence[np.ndarray] | None = None,
    expert_alignment: int = 1,
    num_worst_tokens: int = 0,
    masked_ranks: Iterable[int] = (),
) -> list[DispatchResult | None]:
    """Normal-mode dispatch over ``len(xs)`` simulated ranks.

    ``xs[r]`` is ``[N_r, H]`` bf16, or FP8 (uint8 bits / float8_e4m3fn) with ``x_scales[r]`` ``[N_r, H/128]``
    float32. Each token goes once to every rank that owns at least one of its experts. On rank ``r`` the received
    rows are ordered by source rank, then source token index, and:

    - ``topk_idx`` holds ``expert - r*L`` where the expert lives on ``r`` and -1 elsewhere (int64);
    - ``topk_weights`` holds the weight where ``topk_idx >= 0`` and 0 elsewhere (float32); None if none were given;
    - ``num_recv_tokens_per_expert[e]`` counts received top-k slots naming local expert ``e`` (a token listing ``e``
      twice counts twice), rounded up to a multiple of ``expert_alignment``. The reference returns it in
      worst-token mode too (a GPU run there has no host sync to learn it);
    - with ``num_worst_tokens > 0`` every output has exactly that many rows; padding rows have ``topk_idx`` -1,
      weights 0, and zeros in ``x``/``x_scales`` (GPU kernels leave ``x`` there undefined: compare only the first
      ``handle.num_recv_tokens`` rows of ``x``). More received rows than ``num_worst_tokens`` is an ArgumentError.

    ``masked_ranks`` (shrink mode, the call's mask): those ranks take no part. Nothing arrives from a masked source
    (as if it had no tokens: its rows of ``rank_prefix_matrix`` add nothing), and a masked rank's own result is None.
    """
    num_ranks = len(per_rank("xs", xs))
    masked = _masked_ranks(masked_ranks, num_ranks)
    if masked:  # a masked rank's inputs are not read: a live rank's, cut to no tokens, stand in for them
        live = next((r for r in range(num_ranks) if r not in masked), None)
        if live is None:
            raise argument_error(f"masked_ranks={sorted(masked)} masks every one of the {num_ranks} ranks")
        xs, topk_idx = _no_tokens(xs, live, masked), _no_tokens(topk_idx, live, masked)
        topk_weights = None if topk_weights is None else _no_tokens(topk_weights, live, masked)
        x_scales = None if x_scales is None else _no_tokens(x_scales, live, masked)
    num_experts, num_local = check_num_experts(num_experts, num_ranks)
    topk_idx = per_rank("topk_idx", topk_idx, num_ranks)
    expert_alignment = check_int(expert_alignment, "expert_alignment", 1)
    num_worst_tokens = check_int(num_worst_tokens, "num_worst_tokens", 0)
    inputs = _check_dispatch_inputs(xs, topk_idx, topk_weights, x_scales, num_experts)
    routing = _route_normal(inputs.topk_idx, num_experts)

    results: list[DispatchResult] = []
    for r in range(num_ranks):
        num_recv = int(routing.counts[:, r].sum())
        if num_worst_tokens > 0 and num_recv > num_worst_tokens:
            raise argument_error(f"rank {r} receives {num_recv} tokens but num_worst_tokens={num_worst_tokens}")
        num_rows = num_worst_tokens if num_worst_tokens > 0 else num_recv
        results.append(_dispatch_to_rank(inputs, routing, r, num_rows, num_local, expert_alignment))
    return [None if r in masked else res for r, res in enumerate(results)]


def _no_tokens(arrays: Sequence[Any], live: int, masked: frozenset[int]) -> list[Any]:
    """Each rank's array, a masked rank's replaced by ``live``'s cut to no rows."""
    return [np.asarray(arrays[live])[:0] if r in masked else arrays[r] for r, _ in enumerate(arrays)]


def _check_handles(handles: Sequence[DispatchHandle]) -> None:
    """Check that the handles describe one consistent routing (each rank's rows match the senders' layouts)."""
    num_ranks = len(handles)
    for r, h in enumerate(handles):
        if not isinstance(h, DispatchHandle):
            raise type_error(f"handles[{r}] must be a DispatchHandle, got {type(h).__name__}")
        if h.is_token_in_rank.ndim != 2 or h.is_token_in_rank.shape[1] != num_ranks:
            raise argument_error(
                f"handles[{r}].is_token_in_rank has shape {h.is_token_in_rank.shape} but there are {num_ranks} ranks"
            )
    for r, h in enumerate(handles):
        for s in range(num_ranks):
            got = h.src_token[h.src_rank == s]
            expected = np.flatnonzero(handles[s].is_token_in_rank[:, r])
            if not np.array_equal(got, expected):
                raise argument_error(
                    f"handles[{r}] holds tokens {got.tolist()[:8]}... from rank {s} but handles[{s}] "
                    f"sends {expected.tolist()[:8]}... to rank {r}: the handles are from different routings"
                )


def _check_combine_inputs(
    ys: list[Any], handles: list[DispatchHandle], topk_weights: Sequence[np.ndarray] | None
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Every rank's bf16 ``ys`` (``[num_rows, H]``, rank 0's H) and float32 ``topk_weights`` (``[num_rows, K]``)."""
    num_ranks = len(handles)
    ys_in = [check_bf16(ys[r], f"ys[{r}]", 2) for r in range(num_ranks)]
    hidden = ys_in[0].shape[1]
    for r in range(num_ranks):
        if ys_in[r].shape != (handles[r].num_rows, hidden):
            raise argument_error(
                f"ys[{r}] has shape {ys_in[r].shape} but rank {r} received "
                f"{handles[r].num_rows} rows of hidden={hidden}"
            )
    if topk_weights is None:
        return ys_in, None
    weights_list = per_rank("topk_weights", topk_weights, num_ranks)
    weights_in: list[np.ndarray] = []
    for r in range(num_ranks):
        w = host_array(weights_list[r])
        num_topk = weights_in[0].shape[1] if r > 0 else (w.shape[1] if w.ndim == 2 else -1)
        weights_in.append(check_topk_weights(w, f"topk_weights[{r}]", (handles[r].num_rows, num_topk)))
    return ys_in, weights_in


def _combine_bias(bias: Sequence[Bias] | None, num_tokens: list[int], hidden: int) -> list[np.ndarray]:
    """Each rank's float32 accumulator ``[N_s, H]`` holding ``0 + bias_0 + bias_1`` (zeros without bias)."""
    acc = [np.zeros((n, hidden), dtype=np.float32) for n in num_tokens]
    if bias is None:
        return acc
    bias_list = per_rank("bias", bias, len(num_tokens))
    for s, entry in enumerate(bias_list):
        terms = entry if isinstance(entry, (tuple, list)) else (entry,)
        if len(terms) not in (1, 2):
            raise argument_error(f"bias[{s}] must be one array or a pair of arrays, got {len(terms)} entries")
        for i, term in enumerate(terms):
            b = host_array(term)
            if not is_float_dtype(b.dtype) or b.shape != (num_tokens[s], hidden):
                raise argument_error(
                    f"bias[{s}] term {i} has shape {b.shape} and dtype {b.dtype} but must be "
                    f"floating point of shape {(num_tokens[s], hidden)}"
                )
            acc[s] += b.astype(np.float32)
    return acc


def _add_returned_rows(
    acc: np.ndarray,
    weights_acc: np.ndarray | None,
    src: int,
    ranks: Sequence[int],
    handles: list[DispatchHandle],
    ys: list[np.ndarray],
    weights: list[np.ndarray] | None,
) -> np.ndarray:
    """Add, in float32 and in the order of ``ranks``, the rows that those ranks return to rank ``src``'s tokens
    (and their weight rows); return the mask of the tokens that got at least one row."""
    touched = np.zeros(acc.shape[0], dtype=bool)
    for r in ranks:
        # Rows of rank r that came from rank src: a contiguous block, one row per distinct token.
        rows = np.flatnonzero(handles[r].src_rank == src)
        tokens = handles[r].src_token[rows]
        acc[tokens] += ys[r][rows].astype(np.float32)
        if weights_acc is not None and weights is not None:
            weights_acc[tokens] += weights[r][rows]
        touched[tokens] = True
    return touched


def _fp8_round_trip(rows: np.ndarray) -> np.ndarray:
    """Rows (bf16 or float32 ``[n, H]``) as an FP8 combine sends them: quantised and dequantised (float32)."""
    return fp8_round_trip(rows)


def _fp8_round_trips(ys: list[np.ndarray]) -> list[np.ndarray]:
    """Each rank's rows as the FP8 combine inside one node sends them, row by row."""
    with np.errstate(invalid="ignore", over="ignore"):  # padding rows (never summed) may hold anything
        return [_fp8_round_trip(y) for y in ys]


def combine(
    ys: Sequence[np.ndarray],
    handles: Sequence[DispatchHandle],
    *,
    topk_weights: Sequence[np.ndarray] | None = None,
    bias: Sequence[Bias] | None = None,
    num_nvl_ranks: int | None = None,
    use_fp8: bool = False,
    masked_ranks: Iterable[int] = (),
) -> list[CombineResult | None]:
    """Normal-mode combine, the adjoint of :func:`dispatch`.

    ``ys[r]`` is ``[handles[r].num_rows, H]`` bf16, row ``i`` answering received row ``i`` of rank ``r``
    (padding rows are ignored). Inside one NVLink node (``num_nvl_ranks`` None or ``R``), for each original token
    ``t`` of each rank ``s``::

        x[t] = bf16( float32 sum of: bias_0[t], bias_1[t], then the rows returned for t by ranks 0, 1, ..., R-1 )

    in exactly that order (DeepEP's: bias first, then ranks ascending), cast to bf16 once. Across ``N = R / V``
    nodes of ``V = num_nvl_ranks`` ranks (node ``m`` holds ranks ``[m*V, (m+1)*V)``), each node's rows are summed
    on that node and cross the network as one bf16 partial, so the partial is rounded once more::

        acc = 0 + bias_0[t] + bias_1[t]                                      (float32)
        for m = 0 .. N-1, if some rank of node m returned a row for t:
            p = 0 + the rows returned for t by ranks m*V, m*V+1, ..., m*V+V-1  (float32, those that returned one)
            acc += float32(bf16(p))
        x[t] = bf16(acc)

    With ``V = 1`` this equals the one-node formula bit for bit (a bf16 row rounded to bf16 is itself). A token
    that went nowhere gets its bias (or zeros). ``bias[s]`` is one ``[N_s, H]`` array or a pair of them (both
    added). ``topk_weights[r]`` (``[num_rows, K]``, e.g. ``DispatchResult.topk_weights``) are summed into
    ``[N_s, K]`` in the same order (across nodes: per node over ``j``, then over ``m``) in float32 and never
    rounded to bf16; since each rank holds 0 outside its own experts, this gives back the original weights of the
    slots that named an expert (slots that were -1 come back as 0). ``num_nvl_ranks`` must divide ``R``.

    ``use_fp8=True`` (``Buffer.combine(..., use_fp8=True)``; ``H % 128 == 0``) quantises what crosses the costly
    link, as ``fp8_to_float(*per_token_cast_to_fp8(v))`` (e4m3 with a float32 scale ``amax / 448`` a 128 channels,
    unrounded; the dequantised value a float32 product). Inside one NVLink node every row returned is replaced by
    its round trip before the sum above, whichever rank it comes from, the rank's own included. Across nodes the
    rows are summed as they are and each node's float32 partial takes the round trip in place of its bf16 rounding
    (every node's, the home node's own included)::

            acc += fp8_to_float(*per_token_cast_to_fp8(p))

    With ``V = 1`` both give the same bits. Bias and weights are not quantised.

    ``masked_ranks`` (shrink mode, inside one node): the ranks masked when the combine ended. A masked rank returns
    no rows (its experts' terms are zero) and its own result is None; its ``ys`` and ``handles`` entries are not read
    (None will do), so a rank masked after the dispatch (one that left between dispatch and combine) is dropped here.
    """
    handles = list(per_rank("handles", handles))
    num_ranks = len(handles)
    masked = _masked_ranks(masked_ranks, num_ranks)
    if masked:
        if check_num_nvl_ranks(num_nvl_ranks, num_ranks) is not None:
            raise argument_error("masked_ranks is for one NVLink node (num_nvl_ranks None or the ranks)")
        return _combine_masked(ys, handles, topk_weights, bias, use_fp8, masked)
    nvl = check_num_nvl_ranks(num_nvl_ranks, num_ranks)
    ys = per_rank("ys", ys, num_ranks)
    _check_handles(handles)
    ys_in, weights_in = _check_combine_inputs(ys, handles, topk_weights)
    hidden = ys_in[0].shape[1]
    fp8 = check_flag(use_fp8, "use_fp8")
    if fp8:
        check_hidden_fp8(hidden, "ys")
        if nvl is None:
            ys_in = _fp8_round_trips(ys_in)
    num_tokens = [h.is_token_in_rank.shape[0] for h in handles]
    acc = _combine_bias(bias, num_tokens, hidden)
    weights_acc = None
    if weights_in is not None:
        weights_acc = [np.zeros((n, weights_in[0].shape[1]), dtype=np.float32) for n in num_tokens]

    for s in range(num_ranks):
        w_acc = None if weights_acc is None else weights_acc[s]
        if nvl is None:
            _add_returned_rows(acc[s], w_acc, s, range(num_ranks), handles, ys_in, weights_in)
            continue
        for m in range(num_ranks // nvl):
            partial = np.zeros_like(acc[s])
            w_partial = None if w_acc is None else np.zeros_like(w_acc)
            ranks = range(m * nvl, (m + 1) * nvl)
            touched = _add_returned_rows(partial, w_partial, s, ranks, handles, ys_in, weights_in)
            sent = partial[touched]
            acc[s][touched] += _fp8_round_trip(sent) if fp8 else sent.astype(BF16).astype(np.float32)
            if w_acc is not None and w_partial is not None:
                w_acc[touched] += w_partial[touched]

    return [
        CombineResult(x=acc[s].astype(BF16), topk_weights=None if weights_acc is None else weights_acc[s])
        for s in range(num_ranks)
    ]


def _combine_masked(ys: Sequence[Any], handles: list[Any], topk_weights: Sequence[Any] | None,
                    bias: Sequence[Bias] | None, use_fp8: Any, masked: frozenset[int]) -> list[CombineResult | None]:
    """combine inside one node with masked ranks: a live rank's tokens sum the rows the live ranks return, in rank
    order after the bias; a masked rank's entries are stand-ins (a live rank's), never summed."""
    num_ranks = len(handles)
    live = [r for r in range(num_ranks) if r not in masked]
    if not live:
        raise argument_error(f"masked_ranks={sorted(masked)} masks every one of the {num_ranks} ranks")

    def stand_in(values: Sequence[Any]) -> list[Any]:
        return [values[live[0]] if r in masked else values[r] for r in range(num_ranks)]

    handles = stand_in(handles)
    ys_in, weights_in = _check_combine_inputs(stand_in(per_rank("ys", ys, num_ranks)), handles,
                                              None if topk_weights is None else stand_in(topk_weights))
    if check_flag(use_fp8, "use_fp8"):
        check_hidden_fp8(ys_in[0].shape[1], "ys")
        ys_in = _fp8_round_trips(ys_in)
    num_tokens = [h.is_token_in_rank.shape[0] for h in handles]
    acc = _combine_bias(None if bias is None else stand_in(bias), num_tokens, ys_in[0].shape[1])
    results: list[CombineResult | None] = [None] * num_ranks
    for s in live:
        w_acc = None if weights_in is None else np.zeros((num_tokens[s], weights_in[0].shape[1]), dtype=np.float32)
        _add_returned_rows(acc[s], w_acc, s, live, handles, ys_in, weights_in)
        results[s] = CombineResult(x=acc[s].astype(BF16), topk_weights=w_acc)
    return results
