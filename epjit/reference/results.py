"""The reference's constants and its result records: one record per rank and operation, NumPy arrays inside."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import ml_dtypes
import numpy as np

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


@dataclass(frozen=True, eq=False)
class LowLatencyCombineResult:
    """One home rank's output of low-latency combine."""

    x: np.ndarray  # [N, H] bf16
