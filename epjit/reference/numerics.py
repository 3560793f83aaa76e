"""FP8 e4m3 quantisation as the kernels do it, its inverse, and DeepEP's difference measure."""

from __future__ import annotations

import numpy as np

from ..errors import check_flag
from ._checks import argument_error, check_hidden_fp8, host_array, is_float_dtype, type_error
from .results import FP8, FP8_AMAX_FLOOR, FP8_BLOCK, FP8_MAX


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
    arr = host_array(x)
    if not is_float_dtype(arr.dtype):
        raise type_error(f"x must be bfloat16 or float32, got {arr.dtype}")
    if arr.ndim < 1:
        raise argument_error(f"x must have a hidden dimension, got shape {arr.shape}")
    hidden = arr.shape[-1]
    check_hidden_fp8(hidden, "x")
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


def fp8_round_trip(x: np.ndarray) -> np.ndarray:
    """``fp8_to_float(*per_token_cast_to_fp8(x))`` (float32 ``[..., H]``), bit for bit, without the float8 arrays:
    each block's ``x_f32 * (1 / scale)`` rounded to the nearest e4m3 value in float32 arithmetic, times the scale,
    in place where NumPy allows (the normal FP8 combine's reference rounds tens of millions of values a call)."""
    arr = host_array(x)
    hidden = arr.shape[-1]
    check_hidden_fp8(hidden, "x")
    blocks = arr.astype(np.float32).reshape(*arr.shape[:-1], hidden // FP8_BLOCK, FP8_BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=-1, initial=0.0), np.float32(FP8_AMAX_FLOOR))
    scale = amax / np.float32(FP8_MAX)
    blocks *= (np.float32(1) / scale)[..., None]
    np.clip(blocks, -FP8_MAX, FP8_MAX, out=blocks)
    values = e4m3_nearest(blocks)
    values *= scale[..., None]
    return values.reshape(arr.shape)


def e4m3_nearest(v: np.ndarray) -> np.ndarray:
    """The e4m3 value nearest each float32 in ``[-448, 448]`` (ties to even), as a new float32 array. From the
    smallest normal, 2**-6, up: the float32 mantissa rounded to 3 bits by integer arithmetic on the bits (a carry
    moves the exponent up, as it should). Below it the spacing is 2**-9 (subnormals, and the first normal binade
    alike): ``rint(v * 512) / 512``, exact in float32."""
    bits = v.view(np.uint32)
    rounded = bits >> np.uint32(20)
    rounded &= np.uint32(1)
    rounded += np.uint32(0x7FFFF)
    rounded += bits
    rounded &= np.uint32(0xFFF00000)
    out = rounded.view(np.float32)
    small = np.abs(v) < np.float32(2.0**-6)
    near_zero = v[small] * np.float32(512)
    np.rint(near_zero, out=near_zero)
    near_zero *= np.float32(1 / 512)
    out[small] = near_zero
    return out


def fp8_bits_as_float8(q_bits: np.ndarray) -> np.ndarray:
    """View uint8 e4m3 bits as ``ml_dtypes.float8_e4m3fn`` (no copy of NumPy bits; float8 data comes back as it is)."""
    bits = host_array(q_bits)
    return bits if bits.dtype == FP8 else np.asarray(bits, dtype=np.uint8).view(FP8)


def fp8_bits_to_float32(q_bits: np.ndarray) -> np.ndarray:
    """The float32 values of uint8 e4m3 bits (unscaled)."""
    return fp8_bits_as_float8(q_bits).astype(np.float32)


def ue8m0_to_float(scale_bytes: np.ndarray) -> np.ndarray:
    """float32 ``2**(byte - 127)`` of e8m0 scale bytes (byte 255 is NaN)."""
    b = np.asarray(host_array(scale_bytes), dtype=np.uint8).astype(np.uint32)
    values = (b << 23).view(np.float32)  # byte 0 gives 0, as in the float32 bit layout
    return np.where(b == 0xFF, np.float32(np.nan), values).astype(np.float32)


def fp8_to_float(q_bits: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Dequantise: float32 ``[..., H]`` = e4m3 value * its block's scale (float32 scales or uint8 e8m0 bytes)."""
    values = fp8_bits_to_float32(q_bits)
    s = host_array(scales)
    s = ue8m0_to_float(s) if s.dtype == np.uint8 else s.astype(np.float32)
    if s.shape != (*values.shape[:-1], values.shape[-1] // FP8_BLOCK) or values.shape[-1] % FP8_BLOCK:
        raise argument_error(
            f"scales have shape {s.shape} but data of shape {values.shape} needs one per {FP8_BLOCK} channels"
        )
    return (values.reshape(*s.shape, FP8_BLOCK) * s[..., None]).reshape(values.shape)



LOGFMT_CHANNELS = 128  # a LogFMT group: the channels one amax/amin covers
LOGFMT_MAX_INDEX = (1 << 9) - 1  # 9-bit magnitude indices (the 10th bit is the sign)
LOGFMT_MIN_CLIP = 32.0  # log_amin is at least log_amax - 32


def logfmt_cast_back(x: np.ndarray) -> np.ndarray:
    """DeepEP's LogFMT-10 round trip of bf16 rows ``[..., H]`` (H % 128 == 0), as float32: what a LogFMT combine's
    receiver decodes. Per 128 channels: ``amax``/``amin`` of ``|x|``, ``log_amax = log2(amax)``, ``log_amin =
    max(log2(amin), log_amax - 32)`` (``log_amax - 32`` where ``amin`` is 0). A group with ``log_amax < 0`` and
    ``log_amin < log_amax`` is cast: ``step = (log_amax - log_amin) / 510``, each value to the index
    ``floor(max(log2|x| / step + 2 - log2((1 + 2**step) / 2) / step - log_amin / step, 0))`` (at most 511; the
    rounding puts a value on the nearer, in linear terms, of the two it lies between), decoded as 0 for index 0
    and ``2**((index - 1) * step + log_amin)`` else, with the sign of x. Any other group comes back as its bf16
    values. All in float32 with exact log2/exp2 (the GPU uses approximate ones: tests allow for it)."""
    values = np.asarray(x).astype(np.float32)
    if values.ndim == 0 or values.shape[-1] % LOGFMT_CHANNELS:
        raise argument_error(f"logfmt_cast_back needs a last dimension divisible by {LOGFMT_CHANNELS}, got shape "
                             f"{values.shape}")
    groups = values.reshape(-1, LOGFMT_CHANNELS)
    magnitude = np.abs(groups)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        amax = magnitude.max(axis=1, keepdims=True)
        amin = magnitude.min(axis=1, keepdims=True)
        clip = np.float32(LOGFMT_MIN_CLIP)
        log_amax = np.log2(amax)
        log_amin = np.where(amin == 0, log_amax - clip, np.maximum(np.log2(amin), log_amax - clip))
        cast = (log_amax < 0) & (log_amin < log_amax)
        step = (log_amax - log_amin) / np.float32(LOGFMT_MAX_INDEX - 1)
        step = np.where(cast, step, np.float32(1))  # (uncast groups: any finite step, their result is unused)
        log_amin = np.where(cast, log_amin, np.float32(0))
        step_inv = np.float32(1) / step
        fused = (np.float32(2) - np.log2((np.float32(1) + np.exp2(step)) * np.float32(0.5)) * step_inv
                 - log_amin * step_inv)
        scaled = np.log2(magnitude) * step_inv + fused
        index = np.minimum(np.floor(np.maximum(np.nan_to_num(scaled, nan=0.0), 0)), LOGFMT_MAX_INDEX)
        decoded = np.where(index == 0, np.float32(0),
                           np.exp2((index - np.float32(1)) * step + log_amin)).astype(np.float32)
        decoded = np.where(np.signbit(groups), -decoded, decoded)
    return np.where(cast, decoded, groups).astype(np.float32).reshape(values.shape)


def calc_diff(x: np.ndarray, y: np.ndarray) -> float:
    """DeepEP's difference measure, in float64: ``1 - 2*sum(a*b) / sum(a*a + b*b)`` with ``a = x + 1, b = y + 1``.

    DeepEP's ``calc_diff`` shifts both inputs by 1 (so two all-zero tensors give 0, not NaN); its thresholds
    (e.g. ``< 1e-5`` for bf16) are calibrated with the shift, so it is kept. 0 means equal; NaN anywhere gives NaN.
    """
    a = host_array(x)
    b = host_array(y)
    if a.shape != b.shape:
        raise argument_error(f"calc_diff needs equal shapes, got {a.shape} and {b.shape}")
    a = a.astype(np.float64) + 1.0
    b = b.astype(np.float64) + 1.0
    return float(1.0 - 2.0 * np.sum(a * b) / np.sum(a * a + b * b))
