"""NumPy reference of every epjit operation, over simulated ranks.

This module is the oracle of every GPU test and the CPU backend of the examples. Every function takes the inputs of
*all* ranks at once, as lists indexed by rank (``xs[r]`` is what rank ``r`` would pass to ``Buffer.dispatch``), and
returns one result per rank. It needs numpy and ml_dtypes only, and it never touches a GPU, MPI or the compiler.

Conventions (the same as the GPU API, see docs/api.md):

- ``R`` ranks, ``E`` experts numbered globally, ``L = E / R`` local experts; rank ``r`` owns experts
  ``[r*L, (r+1)*L)``. ``topk_idx`` is ``[N, K]`` (any integer dtype, returned as int64); ``-1`` means "no expert".
- bf16 is ``ml_dtypes.bfloat16``. FP8 is e4m3 (``ml_dtypes.float8_e4m3fn``) carried as **uint8 bit patterns**
  (CuPy has no float8 dtype); :func:`fp8_bits_as_float8` and :func:`fp8_to_float` view or dequantise them.
- A token that lists the same expert in two of its top-k slots is counted and sent **once per slot**, as DeepEP
  does: ``num_tokens_per_expert`` counts it twice, normal dispatch delivers the token once to the owning rank with
  the local id in both slots, and low-latency dispatch delivers two rows.
- Float32 reductions run in a fixed, documented order; a GPU kernel that sums in another order (or with FMA) agrees
  to float32 rounding, not bit for bit. Copies (dispatch) and FP8 quantisation are exact and must match bit for bit.

Validation raises :class:`~epjit.errors.ArgumentError` (bad values) or :class:`~epjit.errors.ArgumentTypeError`
(bad dtypes / containers); messages name the argument, the simulated rank index (``topk_idx[2]``) and the values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import ml_dtypes
import numpy as np

from .errors import ArgumentError, ArgumentTypeError, check_flag, check_int, with_rank

__all__ = [
    "BF16",
    "FP8",
    "FP8_AMAX_FLOOR",
    "FP8_BLOCK",
    "FP8_MAX",
    "POISON_BF16_BITS",
    "POISON_FP8_BITS",
    "POISON_SCALE",
    "POISON_SRC_INFO",
    "POISON_UE8M0",
    "CombineResult",
    "DispatchHandle",
    "DispatchResult",
    "Layout",
    "LowLatencyDispatchResult",
    "LowLatencyHandle",
    "calc_diff",
    "combine",
    "dispatch",
    "fp8_bits_as_float8",
    "fp8_bits_to_float32",
    "fp8_to_float",
    "get_dispatch_layout",
    "low_latency_combine",
    "low_latency_dispatch",
    "pack_layout_range",
    "per_token_cast_to_fp8",
    "rank_of_expert",
    "sort_low_latency_result",
    "ue8m0_to_float",
    "unpack_layout_range",
]

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_BLOCK = 128  # channels per scale
FP8_AMAX_FLOOR = 1e-4  # a block's amax is clamped below at this, so an all-zero block gets a finite scale

# What the reference writes into rows that the semantics call garbage (low-latency rows past recv_count), so that
# a reader of such a row sees NaN or an index that numpy refuses, never a plausible value.
POISON_BF16_BITS = 0x7FFF  # a bf16 NaN
POISON_FP8_BITS = 0x7F  # the e4m3fn NaN
POISON_SCALE = float("nan")  # float32 scales
POISON_UE8M0 = 0xFF  # the e8m0 NaN byte
POISON_SRC_INFO = int(np.iinfo(np.int32).min)  # an index no array accepts

Bias = Union[np.ndarray, tuple[np.ndarray, np.ndarray]]


# --------------------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Layout:
    """What ``get_dispatch_layout`` computes from one rank's ``topk_idx``."""

    num_tokens_per_rank: np.ndarray  # [R] int32: tokens with >= 1 expert on rank r
    num_tokens_per_rdma_rank: np.ndarray | None  # [R / num_nvl_ranks] int32, tokens per node; None with one node
    num_tokens_per_expert: np.ndarray  # [E] int32: top-k slots naming expert e (a repeated expert counts per slot)
    is_token_in_rank: np.ndarray  # [N, R] bool


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """How rank ``r``'s received rows map back to their sources: all that ``combine`` needs.

    ``src_rank``/``src_token`` describe the ``num_recv_tokens`` real rows (ordered by source rank, then source
    token); rows ``[num_recv_tokens, num_rows)`` are worst-token padding. ``is_token_in_rank`` is this rank's own
    routing as a sender (``[N_r, R]``), which gives the row count of the combine output.
    """

    src_rank: np.ndarray  # [M] int32
    src_token: np.ndarray  # [M] int32
    num_recv_tokens: int  # M
    num_rows: int  # rows of the dispatched arrays: num_worst_tokens if > 0, else M
    is_token_in_rank: np.ndarray  # [N_r, R] bool, sender side
    rank_prefix_matrix: np.ndarray  # [R, R] int32: [i, j] = tokens that ranks 0..i send to rank j (as DeepEP)


@dataclass(frozen=True, eq=False)
class DispatchResult:
    """One rank's output of normal dispatch."""

    x: np.ndarray  # [num_rows, H] bf16, or uint8 FP8 bits
    x_scales: np.ndarray | None  # [num_rows, H/128] float32 with FP8, else None
    topk_idx: np.ndarray  # [num_rows, K] int64: local expert ids of this rank's experts, -1 elsewhere
    topk_weights: np.ndarray | None  # [num_rows, K] float32: the weights where topk_idx >= 0, 0 elsewhere
    num_recv_tokens_per_expert: list[int]  # [L], rounded up to expert_alignment
    handle: DispatchHandle


@dataclass(frozen=True, eq=False)
class CombineResult:
    """One rank's output of normal combine."""

    x: np.ndarray  # [N, H] bf16
    topk_weights: np.ndarray | None  # [N, K] float32, the sum of the returned weight rows


@dataclass(frozen=True, eq=False)
class LowLatencyHandle:
    """Rank ``r``'s low-latency receive layout: all that ``low_latency_combine`` needs.

    ``layout_range[e, src] = begin << 32 | count``: rows ``[begin, begin + count)`` of local expert ``e`` came from
    rank ``src``; ``src_info[e, row]`` is the source token index of each of those rows (poison elsewhere).
    """

    src_info: np.ndarray  # [L, R*max] int32
    layout_range: np.ndarray  # [L, R] int64
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int

    @property
    def num_ranks(self) -> int:
        return int(self.layout_range.shape[1])

    @property
    def num_local_experts(self) -> int:
        return int(self.layout_range.shape[0])


@dataclass(frozen=True, eq=False)
class LowLatencyDispatchResult:
    """One rank's output of low-latency dispatch. Rows of expert ``e`` past ``recv_count[e]`` are poison."""

    x: np.ndarray  # [L, R*max, H] uint8 FP8 bits, or bf16
    x_scales: np.ndarray | None  # [L, R*max, H/128] float32 (uint8 e8m0 bytes with use_ue8m0); None for bf16
    recv_count: np.ndarray  # [L] int32
    handle: LowLatencyHandle

    @property
    def src_info(self) -> np.ndarray:
        return self.handle.src_info

    @property
    def layout_range(self) -> np.ndarray:
        return self.handle.layout_range


# --------------------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------------------


def _error(message: str) -> ArgumentError:
    return ArgumentError(with_rank(message))


def _type_error(message: str) -> ArgumentTypeError:
    return ArgumentTypeError(with_rank(message))


def _per_rank(name: str, values: Any, num_ranks: int | None = None) -> list[Any]:
    """Check that ``values`` is a list with one entry per rank (a bare array is the usual mistake)."""
    if isinstance(values, np.ndarray) or not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise _type_error(f"{name} must be a list with one entry per rank, got {type(values).__name__}")
    if num_ranks is None:
        if len(values) == 0:
            raise _error(f"{name} is empty: give one entry per rank (at least one rank)")
    elif len(values) != num_ranks:
        raise _error(f"{name} has {len(values)} entries but there are {num_ranks} ranks")
    return list(values)


def _check_num_experts(num_experts: int, num_ranks: int) -> tuple[int, int]:
    """``(num_experts, num_experts / num_ranks)`` as ints, after checking both."""
    num_experts, num_ranks = check_int(num_experts, "num_experts", None), check_int(num_ranks, "num_ranks", 1)
    if num_experts < 1 or num_experts % num_ranks != 0:
        raise _error(f"num_experts={num_experts} must be a positive multiple of num_ranks={num_ranks}")
    return num_experts, num_experts // num_ranks


def _check_num_nvl_ranks(num_nvl_ranks: Any, num_ranks: int) -> int | None:
    """``num_nvl_ranks`` as an int >= 1 dividing ``num_ranks``; None when it is None or ``num_ranks`` (one node)."""
    if num_nvl_ranks is None:
        return None
    num_nvl_ranks = check_int(num_nvl_ranks, "num_nvl_ranks", None)
    if num_nvl_ranks < 1 or num_ranks % num_nvl_ranks != 0:
        raise _error(f"num_nvl_ranks={num_nvl_ranks} must be >= 1 and divide num_ranks={num_ranks}")
    return None if num_nvl_ranks == num_ranks else num_nvl_ranks


def _is_float_dtype(dtype: np.dtype) -> bool:
    return dtype == BF16 or np.issubdtype(dtype, np.floating)


def _check_topk_idx(
    topk_idx: Any, name: str, num_tokens: int | None, num_topk: int | None, num_experts: int
) -> np.ndarray:
    """Return ``topk_idx`` as int64 ``[N, K]`` after checking its shape and that it lies in ``[-1, num_experts)``."""
    idx = np.asarray(topk_idx)
    if not np.issubdtype(idx.dtype, np.integer):
        raise _type_error(f"{name} must have an integer dtype (int64), got {idx.dtype}")
    if idx.ndim != 2:
        raise _error(f"{name} must be 2-D [num_tokens, num_topk], got shape {idx.shape}")
    if num_tokens is not None and idx.shape[0] != num_tokens:
        raise _error(f"{name} has {idx.shape[0]} rows but the rank has {num_tokens} tokens")
    if num_topk is not None and idx.shape[1] != num_topk:
        raise _error(f"{name} has num_topk={idx.shape[1]} but rank 0 has num_topk={num_topk}")
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= num_experts:
            raise _error(f"{name} has values in [{lo}, {hi}] but must lie in [-1, {num_experts}) (num_experts)")
    return idx.astype(np.int64, copy=False)


def _check_topk_weights(topk_weights: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
    w = np.asarray(topk_weights)
    if not _is_float_dtype(w.dtype):
        raise _type_error(f"{name} must be floating point (float32), got {w.dtype}")
    if w.shape != shape:
        raise _error(f"{name} has shape {w.shape} but topk_idx has shape {shape}")
    return w.astype(np.float32, copy=False)


def _check_bf16(x: Any, name: str, ndim: int) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype != BF16:
        raise _type_error(f"{name} must be bfloat16 (ml_dtypes.bfloat16), got {arr.dtype}")
    if arr.ndim != ndim:
        raise _error(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return arr


def _check_fp8_bits(x: Any, name: str) -> np.ndarray:
    """Accept FP8 data as uint8 bits or as float8_e4m3fn values; return the uint8 bits."""
    arr = np.asarray(x)
    if arr.dtype == FP8:
        return arr.view(np.uint8)
    if arr.dtype != np.uint8:
        raise _type_error(
            f"{name} must be FP8 e4m3 (uint8 bits or float8_e4m3fn) since x_scales were given, got {arr.dtype}"
        )
    return arr


def _check_hidden_fp8(hidden: int, name: str) -> None:
    if hidden % FP8_BLOCK != 0:
        raise _error(f"{name} has hidden={hidden}, which must be a multiple of {FP8_BLOCK} for FP8")


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _poison_bf16(shape: tuple[int, ...]) -> np.ndarray:
    return np.full(shape, POISON_BF16_BITS, dtype=np.uint16).view(BF16)


# --------------------------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------------------------


def rank_of_expert(expert: int, num_experts: int, num_ranks: int) -> int:
    """The rank that owns global expert ``expert``: rank ``r`` owns ``[r*E/R, (r+1)*E/R)``."""
    num_experts, num_local = _check_num_experts(num_experts, num_ranks)
    expert = check_int(expert, "expert", None)
    if not 0 <= expert < num_experts:
        raise _error(f"expert={expert} must lie in [0, {num_experts}) (num_experts)")
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
    num_experts, num_local = _check_num_experts(num_experts, num_ranks)
    num_ranks = int(num_ranks)
    num_nvl_ranks = _check_num_nvl_ranks(num_nvl_ranks, num_ranks)
    idx = _check_topk_idx(topk_idx, "topk_idx", None, None, num_experts)
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


# --------------------------------------------------------------------------------------------------------------
# Normal mode
# --------------------------------------------------------------------------------------------------------------


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
        bits = _check_fp8_bits(x, name)
        if bits.ndim != 2:
            raise _error(f"{name} must be 2-D [num_tokens, hidden], got shape {bits.shape}")
        return bits
    arr = np.asarray(x)
    # FP8 data without scales cannot be dequantised by the receiver, so name the missing argument.
    if arr.dtype in (np.uint8, FP8):
        raise _type_error(f"{name} is FP8 ({arr.dtype}) but x_scales is None: pass the float32 scales")
    return _check_bf16(arr, name, 2)


def _check_dispatch_scales(scales: list[Any], xs: list[np.ndarray]) -> list[np.ndarray]:
    """Every rank's FP8 scales: float32, one per token and block of 128 channels."""
    hidden = xs[0].shape[1]
    _check_hidden_fp8(hidden, "xs")
    checked: list[np.ndarray] = []
    for r, scale in enumerate(scales):
        s = np.asarray(scale)
        if s.dtype != np.float32:
            raise _type_error(f"x_scales[{r}] must be float32, got {s.dtype}")
        if s.shape != (xs[r].shape[0], hidden // FP8_BLOCK):
            raise _error(f"x_scales[{r}] has shape {s.shape} but must be {(xs[r].shape[0], hidden // FP8_BLOCK)}")
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
    scales_list = _per_rank("x_scales", x_scales, num_ranks) if use_fp8 else None
    weights_list = _per_rank("topk_weights", topk_weights, num_ranks) if topk_weights is not None else None
    xs_in: list[np.ndarray] = []
    idx_in: list[np.ndarray] = []
    weights_in: list[np.ndarray] | None = [] if weights_list is not None else None
    for r in range(num_ranks):
        x = _check_dispatch_x(xs[r], f"xs[{r}]", use_fp8)
        if r > 0 and x.shape[1] != xs_in[0].shape[1]:
            raise _error(f"xs[{r}] has hidden={x.shape[1]} but xs[0] has hidden={xs_in[0].shape[1]}")
        xs_in.append(x)
        num_topk = idx_in[0].shape[1] if r > 0 else None
        idx_in.append(_check_topk_idx(topk_idx[r], f"topk_idx[{r}]", x.shape[0], num_topk, num_experts))
        if weights_list is not None and weights_in is not None:
            weights_in.append(_check_topk_weights(weights_list[r], f"topk_weights[{r}]", idx_in[r].shape))
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
        num_recv_tokens_per_expert=[_align_up(int(c), expert_alignment) for c in per_expert],
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
) -> list[DispatchResult]:
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
    """
    num_ranks = len(_per_rank("xs", xs))
    num_experts, num_local = _check_num_experts(num_experts, num_ranks)
    topk_idx = _per_rank("topk_idx", topk_idx, num_ranks)
    expert_alignment = check_int(expert_alignment, "expert_alignment", 1)
    num_worst_tokens = check_int(num_worst_tokens, "num_worst_tokens", 0)
    inputs = _check_dispatch_inputs(xs, topk_idx, topk_weights, x_scales, num_experts)
    routing = _route_normal(inputs.topk_idx, num_experts)

    results: list[DispatchResult] = []
    for r in range(num_ranks):
        num_recv = int(routing.counts[:, r].sum())
        if num_worst_tokens > 0 and num_recv > num_worst_tokens:
            raise _error(f"rank {r} receives {num_recv} tokens but num_worst_tokens={num_worst_tokens}")
        num_rows = num_worst_tokens if num_worst_tokens > 0 else num_recv
        results.append(_dispatch_to_rank(inputs, routing, r, num_rows, num_local, expert_alignment))
    return results


def _check_handles(handles: Sequence[DispatchHandle]) -> None:
    """Check that the handles describe one consistent routing (each rank's rows match the senders' layouts)."""
    num_ranks = len(handles)
    for r, h in enumerate(handles):
        if not isinstance(h, DispatchHandle):
            raise _type_error(f"handles[{r}] must be a DispatchHandle, got {type(h).__name__}")
        if h.is_token_in_rank.ndim != 2 or h.is_token_in_rank.shape[1] != num_ranks:
            raise _error(
                f"handles[{r}].is_token_in_rank has shape {h.is_token_in_rank.shape} but there are {num_ranks} ranks"
            )
    for r, h in enumerate(handles):
        for s in range(num_ranks):
            got = h.src_token[h.src_rank == s]
            expected = np.flatnonzero(handles[s].is_token_in_rank[:, r])
            if not np.array_equal(got, expected):
                raise _error(
                    f"handles[{r}] holds tokens {got.tolist()[:8]}... from rank {s} but handles[{s}] "
                    f"sends {expected.tolist()[:8]}... to rank {r}: the handles are from different routings"
                )


def _check_combine_inputs(
    ys: list[Any], handles: list[DispatchHandle], topk_weights: Sequence[np.ndarray] | None
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Every rank's bf16 ``ys`` (``[num_rows, H]``, rank 0's H) and float32 ``topk_weights`` (``[num_rows, K]``)."""
    num_ranks = len(handles)
    ys_in = [_check_bf16(ys[r], f"ys[{r}]", 2) for r in range(num_ranks)]
    hidden = ys_in[0].shape[1]
    for r in range(num_ranks):
        if ys_in[r].shape != (handles[r].num_rows, hidden):
            raise _error(
                f"ys[{r}] has shape {ys_in[r].shape} but rank {r} received "
                f"{handles[r].num_rows} rows of hidden={hidden}"
            )
    if topk_weights is None:
        return ys_in, None
    weights_list = _per_rank("topk_weights", topk_weights, num_ranks)
    weights_in: list[np.ndarray] = []
    for r in range(num_ranks):
        w = np.asarray(weights_list[r])
        num_topk = weights_in[0].shape[1] if r > 0 else (w.shape[1] if w.ndim == 2 else -1)
        weights_in.append(_check_topk_weights(w, f"topk_weights[{r}]", (handles[r].num_rows, num_topk)))
    return ys_in, weights_in


def _combine_bias(bias: Sequence[Bias] | None, num_tokens: list[int], hidden: int) -> list[np.ndarray]:
    """Each rank's float32 accumulator ``[N_s, H]`` holding ``0 + bias_0 + bias_1`` (zeros without bias)."""
    acc = [np.zeros((n, hidden), dtype=np.float32) for n in num_tokens]
    if bias is None:
        return acc
    bias_list = _per_rank("bias", bias, len(num_tokens))
    for s, entry in enumerate(bias_list):
        terms = entry if isinstance(entry, (tuple, list)) else (entry,)
        if len(terms) not in (1, 2):
            raise _error(f"bias[{s}] must be one array or a pair of arrays, got {len(terms)} entries")
        for i, term in enumerate(terms):
            b = np.asarray(term)
            if not _is_float_dtype(b.dtype) or b.shape != (num_tokens[s], hidden):
                raise _error(
                    f"bias[{s}] term {i} has shape {b.shape} and dtype {b.dtype} but must be "
                    f"floating point of shape {(num_tokens[s], hidden)}"
                )
            acc[s] += b.astype(np.float32)
    return acc


def _add_returned_rows(
    acc: np.ndarray,
    weights_acc: np.ndarray | None,
    src: int,
    ranks: range,
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


def combine(
    ys: Sequence[np.ndarray],
    handles: Sequence[DispatchHandle],
    *,
    topk_weights: Sequence[np.ndarray] | None = None,
    bias: Sequence[Bias] | None = None,
    num_nvl_ranks: int | None = None,
) -> list[CombineResult]:
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
    """
    handles = _per_rank("handles", handles)
    num_ranks = len(handles)
    nvl = _check_num_nvl_ranks(num_nvl_ranks, num_ranks)
    ys = _per_rank("ys", ys, num_ranks)
    _check_handles(handles)
    ys_in, weights_in = _check_combine_inputs(ys, handles, topk_weights)
    hidden = ys_in[0].shape[1]
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
            acc[s][touched] += partial[touched].astype(BF16).astype(np.float32)
            if w_acc is not None and w_partial is not None:
                w_acc[touched] += w_partial[touched]

    return [
        CombineResult(x=acc[s].astype(BF16), topk_weights=None if weights_acc is None else weights_acc[s])
        for s in range(num_ranks)
    ]


# --------------------------------------------------------------------------------------------------------------
# FP8
# --------------------------------------------------------------------------------------------------------------


def _pow2_ceil(values: np.ndarray) -> np.ndarray:
    """Smallest power of two >= each positive normal float32, from the bits (what a kernel does, no log2 rounding)."""
    bits = values.astype(np.float32).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + ((bits & 0x7FFFFF) != 0)
    return np.ldexp(np.float32(1), exponent).astype(np.float32)


def per_token_cast_to_fp8(
    x: np.ndarray, *, round_scale: bool = False, use_ue8m0: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Quantise ``x`` ``[..., H]`` (bf16 or float32, finite) to e4m3 with one scale per 128 channels.

    Exactly, for each block of 128 channels (kernels replicate this bit for bit):

    1. ``amax = max(max|x_f32|, 1e-4)`` in float32;
    2. ``scale = amax / 448`` (float32 division); with ``round_scale`` (implied by ``use_ue8m0``) the smallest
       power of two ``>= scale``, i.e. ``2**ceil(log2(scale))`` computed exactly from the float32 bits;
    3. ``q = e4m3(clip(x_f32 * (1 / scale), -448, 448))``: ``1 / scale`` is a float32 division, the product a
       float32 multiply, the conversion round-to-nearest-even (saturating, which the clip makes explicit).

    Returns ``(q_bits uint8 [..., H], scales)``: scales float32 ``[..., H/128]``, or with ``use_ue8m0`` uint8
    ``[..., H/128]`` holding the biased exponent byte of the power-of-two scale (``scale = 2**(byte - 127)``, the
    float32 bits are ``byte << 23``); one byte per block, not packed four to an int32 as DeepEP's kernels do.
    """
    arr = np.asarray(x)
    if not _is_float_dtype(arr.dtype):
        raise _type_error(f"x must be bfloat16 or float32, got {arr.dtype}")
    if arr.ndim < 1:
        raise _error(f"x must have a hidden dimension, got shape {arr.shape}")
    hidden = arr.shape[-1]
    _check_hidden_fp8(hidden, "x")
    use_ue8m0 = check_flag(use_ue8m0, "use_ue8m0")
    round_scale = check_flag(round_scale, "round_scale") or use_ue8m0

    blocks = arr.astype(np.float32).reshape(*arr.shape[:-1], hidden // FP8_BLOCK, FP8_BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=-1, initial=0.0), np.float32(FP8_AMAX_FLOOR))
    scale = amax / np.float32(FP8_MAX)
    if round_scale:
        scale = _pow2_ceil(scale)
    inverse = np.float32(1) / scale
    scaled = blocks * inverse[..., None]
    # The kernels convert with satfinite; ml_dtypes would give NaN past 464 instead. With scale = amax/448 the
    # product stays below 464 (it rounds to 448), so the clip is a safeguard that never changes a result here.
    q = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8).view(np.uint8).reshape(arr.shape)
    if use_ue8m0:
        return q, ((scale.view(np.uint32) >> 23) & 0xFF).astype(np.uint8)
    return q, scale.astype(np.float32)


def fp8_bits_as_float8(q_bits: np.ndarray) -> np.ndarray:
    """View uint8 e4m3 bits as ``ml_dtypes.float8_e4m3fn`` (no copy)."""
    return np.asarray(q_bits, dtype=np.uint8).view(FP8)


def fp8_bits_to_float32(q_bits: np.ndarray) -> np.ndarray:
    """The float32 values of uint8 e4m3 bits (unscaled)."""
    return fp8_bits_as_float8(q_bits).astype(np.float32)


def ue8m0_to_float(scale_bytes: np.ndarray) -> np.ndarray:
    """float32 ``2**(byte - 127)`` of e8m0 scale bytes (byte 255 is NaN)."""
    b = np.asarray(scale_bytes, dtype=np.uint8).astype(np.uint32)
    values = (b << 23).view(np.float32)  # byte 0 gives 0, as in the float32 bit layout
    return np.where(b == 0xFF, np.float32(np.nan), values).astype(np.float32)


def fp8_to_float(q_bits: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Dequantise: float32 ``[..., H]`` = e4m3 value * its block's scale (float32 scales or uint8 e8m0 bytes)."""
    values = fp8_bits_to_float32(q_bits)
    s = np.asarray(scales)
    s = ue8m0_to_float(s) if s.dtype == np.uint8 else s.astype(np.float32)
    if s.shape != (*values.shape[:-1], values.shape[-1] // FP8_BLOCK) or values.shape[-1] % FP8_BLOCK:
        raise _error(f"scales have shape {s.shape} but data of shape {values.shape} needs one per {FP8_BLOCK} channels")
    return (values.reshape(*s.shape, FP8_BLOCK) * s[..., None]).reshape(values.shape)


# --------------------------------------------------------------------------------------------------------------
# Low-latency mode
# --------------------------------------------------------------------------------------------------------------


def pack_layout_range(begin: np.ndarray | int, count: np.ndarray | int) -> np.ndarray:
    """``begin << 32 | count`` as int64 (the layout_range encoding)."""
    parts = []
    for name, value in (("begin", begin), ("count", count)):
        part = np.asarray(value)
        if not np.issubdtype(part.dtype, np.integer):  # np.asarray(3.7 or "3", dtype=np.int64) would take it
            shown = repr(value) if part.ndim == 0 else f"an array of {part.dtype}"
            raise _type_error(f"{name} must be an int or an integer array, got {shown}")
        parts.append(part.astype(np.int64))
    return (parts[0] << 32) | parts[1]


def unpack_layout_range(layout_range: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(begin, count)`` of each ``layout_range`` entry, as int64 arrays."""
    packed = np.asarray(layout_range, dtype=np.int64)
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
        x = _check_bf16(xs[r], f"xs[{r}]", 2)
        if r > 0 and x.shape[1] != xs_in[0].shape[1]:
            raise _error(f"xs[{r}] has hidden={x.shape[1]} but xs[0] has hidden={xs_in[0].shape[1]}")
        if x.shape[0] > max_tokens:
            raise _error(f"xs[{r}] has {x.shape[0]} tokens but num_max_dispatch_tokens_per_rank={max_tokens}")
        xs_in.append(x)
        num_topk = idx_in[0].shape[1] if r > 0 else None
        idx_in.append(_check_topk_idx(topk_idx[r], f"topk_idx[{r}]", x.shape[0], num_topk, num_experts))
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
        return _poison_bf16((num_local, num_rows, hidden)), None
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
) -> LowLatencyDispatchResult:
    """What rank ``rank`` receives: for each local expert, the source blocks in rank order (``slots[s]`` is
    :func:`_slots_by_expert` of rank ``s``)."""
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
            # Each (expert, source) receive slot has room for max_tokens rows; only repeated experts overflow it.
            if len(tokens) > max_tokens:
                raise _error(
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
) -> list[LowLatencyDispatchResult]:
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
    """
    num_ranks = len(_per_rank("xs", xs))
    num_experts = _check_num_experts(num_experts, num_ranks)[0]
    topk_idx = _per_rank("topk_idx", topk_idx, num_ranks)
    max_tokens = check_int(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", 1)
    use_fp8, round_scale, use_ue8m0 = (check_flag(v, n) for v, n in (
        (use_fp8, "use_fp8"), (round_scale, "round_scale"), (use_ue8m0, "use_ue8m0")))
    if not use_fp8 and (round_scale or use_ue8m0):
        raise _error(f"round_scale={round_scale} and use_ue8m0={use_ue8m0} need use_fp8=True")
    xs_in, idx_in = _check_low_latency_inputs(xs, topk_idx, max_tokens, num_experts)
    hidden = xs_in[0].shape[1]
    if use_fp8:
        _check_hidden_fp8(hidden, "xs")

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
        )
        for r in range(num_ranks)
    ]


def _check_ll_block(handle: LowLatencyHandle, name: str, e: int, s: int) -> np.ndarray:
    """Rows of rank ``r``'s local expert ``e`` that came from rank ``s``, checked to lie inside the buffer."""
    begin, count = (int(v) for v in unpack_layout_range(handle.layout_range[e, s]))
    capacity = handle.src_info.shape[1]
    if begin < 0 or begin + count > capacity:
        raise _error(
            f"{name}.layout_range[{e}, {s}] = (begin {begin}, count {count}) "
            f"lies outside the {capacity} rows of an expert"
        )
    return np.arange(begin, begin + count)


def low_latency_combine(
    ys: Sequence[np.ndarray],
    topk_idx: Sequence[np.ndarray],
    topk_weights: Sequence[np.ndarray],
    handles: Sequence[LowLatencyHandle],
) -> list[np.ndarray]:
    """Low-latency combine over simulated ranks; returns each home rank's ``[N, H]`` bf16.

    ``ys[r]`` is ``[L, R*max, H]`` bf16, the expert outputs in rank ``r``'s received layout (``handles[r]``; rows
    past each block are never read, so they may hold anything). ``topk_idx[s]``/``topk_weights[s]`` are home rank
    ``s``'s routing, as given to dispatch. For each token ``t``::

        x[t] = bf16( sum over k = 0..K-1 with topk_idx[t, k] >= 0 of float32(w[t, k]) * float32(y[row of (t, k)]) )

    accumulated in float32 in k order and cast once. The row of ``(t, k)`` is found from the handle alone (the
    block ``layout_range[e, s]`` and ``src_info``), so a handle from a kernel that orders rows differently works
    too. With a repeated expert, the j-th row of token ``t`` in its block (rows sorted stably by ``src_info``)
    answers the j-th slot of ``t`` naming that expert; the rows hold the same token, so any pairing gives the same
    sum for an expert that maps equal inputs to equal outputs.
    """
    handles = _per_rank("handles", handles)
    num_ranks = len(handles)
    for r, h in enumerate(handles):
        if not isinstance(h, LowLatencyHandle):
            raise _type_error(f"handles[{r}] must be a LowLatencyHandle, got {type(h).__name__}")
        if h.num_ranks != num_ranks:
            raise _error(f"handles[{r}] is for {h.num_ranks} ranks but {num_ranks} handles were given")
        if h.num_experts != handles[0].num_experts:
            raise _error(f"handles[{r}] has num_experts={h.num_experts} but handles[0] has {handles[0].num_experts}")
    num_experts, num_local = _check_num_experts(handles[0].num_experts, num_ranks)
    ys = _per_rank("ys", ys, num_ranks)
    topk_idx = _per_rank("topk_idx", topk_idx, num_ranks)
    topk_weights = _per_rank("topk_weights", topk_weights, num_ranks)

    ys_in = [_check_bf16(ys[r], f"ys[{r}]", 3) for r in range(num_ranks)]
    hidden = ys_in[0].shape[2]
    for r in range(num_ranks):
        expected = (num_local, handles[r].src_info.shape[1], hidden)
        if ys_in[r].shape != expected:
            raise _error(f"ys[{r}] has shape {ys_in[r].shape} but handles[{r}] describes {expected}")
    idx_in: list[np.ndarray] = []
    weights_in: list[np.ndarray] = []
    for s in range(num_ranks):
        num_topk = idx_in[0].shape[1] if s > 0 else None
        idx_in.append(_check_topk_idx(topk_idx[s], f"topk_idx[{s}]", None, num_topk, num_experts))
        weights_in.append(_check_topk_weights(topk_weights[s], f"topk_weights[{s}]", idx_in[s].shape))

    outputs: list[np.ndarray] = []
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
                    raise _error(
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
        outputs.append(acc.astype(BF16))
    return outputs


def sort_low_latency_result(result: LowLatencyDispatchResult) -> LowLatencyDispatchResult:
    """Reorder a low-latency result (e.g. a GPU one) into the reference order, to compare it with ``==``.

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
            raise _error(f"layout_range of expert {e} covers {begin} rows but recv_count[{e}]={result.recv_count[e]}")
        x[e, :begin] = result.x[e, rows]
        src_info[e, :begin] = handle.src_info[e, rows]
        if x.dtype == np.uint8:
            x[e, begin:] = POISON_FP8_BITS
        else:
            x[e, begin:] = _poison_bf16(x[e, begin:].shape)
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


# --------------------------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------------------------


def calc_diff(x: np.ndarray, y: np.ndarray) -> float:
    """DeepEP's difference measure, in float64: ``1 - 2*sum(a*b) / sum(a*a + b*b)`` with ``a = x + 1, b = y + 1``.

    DeepEP's ``calc_diff`` shifts both inputs by 1 (so two all-zero tensors give 0, not NaN); its thresholds
    (e.g. ``< 1e-5`` for bf16) are calibrated with the shift, so it is kept. 0 means equal; NaN anywhere gives NaN.
    """
    a = np.asarray(x)
    b = np.asarray(y)
    if a.shape != b.shape:
        raise _error(f"calc_diff needs equal shapes, got {a.shape} and {b.shape}")
    a = a.astype(np.float64) + 1.0
    b = b.astype(np.float64) + 1.0
    return float(1.0 - 2.0 * np.sum(a * b) / np.sum(a * a + b * b))
