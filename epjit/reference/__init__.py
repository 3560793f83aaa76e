"""NumPy reference of every epjit operation, over simulated ranks.

This package is the oracle of every GPU test and the CPU backend of the examples. Every function takes the inputs of
*all* ranks at once, as lists indexed by rank (``xs[r]`` is what rank ``r`` would pass to ``Buffer.dispatch``), and
returns one result per rank. It needs numpy and ml_dtypes only, and it never touches a GPU, MPI or the compiler.

Inputs may be NumPy, PyTorch (any device; bf16 and float8_e4m3fn included), JAX or CuPy arrays, mixed freely: each
is copied to the host as a NumPy array first (bf16 as ``ml_dtypes.bfloat16``, bit for bit). Outputs are NumPy
arrays, in one record per rank and operation whose fields are named as the GPU API's (``.x`` the tokens).
Modules: ``normal`` (layout, dispatch, combine), ``low_latency``, ``numerics`` (FP8, calc_diff), ``results`` (the
records and constants); every public name is here.

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

from .low_latency import (
    low_latency_combine,
    low_latency_dispatch,
    pack_layout_range,
    sort_low_latency_result,
    unpack_layout_range,
)
from .normal import combine, dispatch, get_dispatch_layout, rank_of_expert
from .numerics import (
    calc_diff,
    fp8_bits_as_float8,
    fp8_bits_to_float32,
    fp8_to_float,
    logfmt_cast_back,
    per_token_cast_to_fp8,
    ue8m0_to_float,
)
from .results import (
    BF16,
    FP8,
    FP8_AMAX_FLOOR,
    FP8_BLOCK,
    FP8_MAX,
    POISON_BF16_BITS,
    POISON_FP8_BITS,
    POISON_SCALE,
    POISON_SRC_INFO,
    POISON_UE8M0,
    Bias,
    CombineResult,
    DispatchHandle,
    DispatchResult,
    Layout,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)

__all__ = [
    "BF16",
    "Bias",
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
    "LowLatencyCombineResult",
    "LowLatencyDispatchResult",
    "LowLatencyHandle",
    "calc_diff",
    "combine",
    "dispatch",
    "fp8_bits_as_float8",
    "fp8_bits_to_float32",
    "fp8_to_float",
    "get_dispatch_layout",
    "logfmt_cast_back",
    "low_latency_combine",
    "low_latency_dispatch",
    "pack_layout_range",
    "per_token_cast_to_fp8",
    "rank_of_expert",
    "sort_low_latency_result",
    "ue8m0_to_float",
    "unpack_layout_range",
]
