"""FP8 KV caches: quantize a 16-bit cache, and back.

Two layouts. DeepSeek-V3.2's sparse one (``quantize_fp8_sparse``, "V32_FP8Sparse" in FlashMLA),
below, and the dense one with a single scale per tensor (``quantize_fp8_per_tensor``, vLLM's
``k_scale`` convention): every value of the tensor is ``fp8 * scale``.

DeepSeek-V3.2's sparse layout: one token of the cache is 656 bytes, one 576-value K row (V is its first 512 values)::

    bytes [0, 512)     the 512 "NoPE" values, float8_e4m3fn
    bytes [512, 528)   4 float32 scales: scale i belongs to NoPE values [128 i, 128 i + 128)
    bytes [528, 656)   the 64 RoPE values, bfloat16, not quantized

A NoPE value is ``fp8 * scale``. The functions work on the last axis, so any leading shape
carries over: a paged cache ``[num_blocks, page_block_size, 1, 576]`` becomes
``[num_blocks, page_block_size, 1, 656]`` and back. NumPy or CuPy arrays, the result in the same
library, by the same array code (no loop over tokens): both give the same bytes.

The quantization is FlashMLA's (``tests/quant.py``), bit for bit. Per 128-value tile of a row:

* ``scale = 2 ** ceil(log2(max(amax(|x|) / 448, 1e-4)))`` in float32 -- a power of two, at
  least ``2**-13``, and the smallest one with ``amax / scale <= 448`` (e4m3's largest value);
* ``fp8 = float8_e4m3fn(float32(x) / scale)``, rounded to nearest, ties to even, as torch's
  ``.to(torch.float8_e4m3fn)`` rounds.

A tile that holds inf or NaN gets an inf or NaN scale and dequantizes to NaN, as upstream's
does. The scales and the RoPE part are stored little-endian, as on every CUDA host.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .baselines import from_float32, to_compute
from .constants import FP8_NUM_SCALES, FP8_QUANT_TILE, FP8_TOKEN_BYTES, HEAD_DIM_K, HEAD_DIM_V

SCALES_OFFSET = HEAD_DIM_V                          # byte offset of the 4 scales in a token
ROPE_OFFSET = SCALES_OFFSET + 4 * FP8_NUM_SCALES    # byte offset of the 64 bf16 RoPE values
E4M3_MAX = 448.0                                    # float8_e4m3fn's largest finite value
E4M3_NAN_CODE = 0x7F                                # a float8_e4m3fn NaN (0xFF is the other)
MIN_SCALE_BOUND = 1e-4                              # upstream's floor under amax / 448
BYTE_DTYPES = ("uint8", "int8", "float8_e4m3fn")    # dtypes read as the cache's bytes

# The value of each of the 256 float8_e4m3fn codes: dequantizing is a table lookup.
_E4M3FN_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)

_DEQUANTIZED_DTYPES = ("float32", "float64", "bfloat16")


def quantize_fp8_per_tensor(x, scale=None):
    """float8_e4m3fn codes of ``x`` with one float32 scale for the whole tensor: ``x ~ fp8 * scale``.

    The dense FP8 cache's convention (vLLM's per-tensor ``k_scale``, and ``q_scale`` for an FP8
    q). ``fp8 = e4m3fn(clip(float32(x) / scale, -448, 448))``, rounded to nearest even and
    saturating at e4m3's largest value, as vLLM's ``scaled_fp8_quant`` does (it multiplies by
    ``1 / scale`` on the GPU, which can round the last bit differently).

    Args:
        x: any shape (e.g. a paged cache ``[num_blocks, page_block_size, h_kv, 576]``),
            ``ml_dtypes.bfloat16``, float16 or float32, finite; NumPy or CuPy.
        scale: a positive finite number, or None: ``amax(|x|) / 448`` in float32 (1 for an
            all-zero ``x``), so that the largest magnitude becomes 448.

    Returns:
        ``(codes, scale)``: uint8 codes of x's shape (CuPy has no float8 dtype; NumPy callers
        may ``.view(ml_dtypes.float8_e4m3fn)``) and the float32 scale as a 0-d array, both in
        x's library.
    """
    if x.dtype.name not in ("bfloat16", "float16", "float32"):
        raise TypeError(f"x must be ml_dtypes.bfloat16, float16 or float32; got {x.dtype}")
    xp = _array_module(x)
    values = to_compute(x)                                             # float32, exact
    if not bool(xp.isfinite(values).all()):
        raise ValueError("x must be finite (no inf or NaN): one scale serves the whole tensor")
    if scale is None:
        amax = xp.abs(values).max() if values.size else xp.float32(0)
        scale = xp.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    else:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise TypeError(f"scale must be a number or None; got {type(scale).__name__}")
        if not (math.isfinite(scale) and np.float32(scale) > 0):
            raise ValueError(f"scale must be positive and finite in float32; got {scale!r}")
        scale = xp.asarray(scale, dtype=np.float32)
    scaled = xp.clip(values / scale, np.float32(-E4M3_MAX), np.float32(E4M3_MAX)).astype(np.float32)
    return _float32_to_e4m3fn(xp.ascontiguousarray(scaled), xp), scale


def dequantize_fp8_per_tensor(codes, scale, dtype=np.float32):
    """``fp8 * scale`` of float8_e4m3fn codes (``quantize_fp8_per_tensor``'s convention).

    Args:
        codes: uint8, int8 or ``ml_dtypes.float8_e4m3fn``, any shape, NumPy or CuPy.
        scale: the float32 scale (a number or a 0-d / 1-element array of either library).
        dtype: of the result: ``float32`` (default), ``float64`` or ``ml_dtypes.bfloat16``;
            computed in float32 (float64 for a float64 result), then rounded to ``dtype``.

    Returns:
        An array of codes' shape and library; the NaN codes (0x7F, 0xFF) give NaN.
    """
    name = np.dtype(dtype).name
    if name not in _DEQUANTIZED_DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(_DEQUANTIZED_DTYPES)}; got {name}")
    if codes.dtype.name not in BYTE_DTYPES:
        raise TypeError(f"codes must hold bytes (uint8, int8 or float8_e4m3fn); got {codes.dtype}")
    xp = _array_module(codes)
    compute = np.float64 if name == "float64" else np.float32
    scale = xp.asarray(scale, dtype=np.float32).reshape(()).astype(compute)
    values = xp.asarray(_E4M3FN_VALUES.astype(compute))[codes.view(xp.uint8)] * scale
    return from_float32(values, dtype) if name == "bfloat16" else values


def _array_module(x):
    try:
        import cupy
    except ImportError:
        return np
    return cupy.get_array_module(x)


def quantize_fp8_sparse(kv):
    """Quantize K rows to the 656-byte V3.2 FP8 layout.

    Args:
        kv: ``[..., 576]`` ``ml_dtypes.bfloat16`` (the cache's own dtype upstream), NumPy or CuPy.
            Other dtypes are refused rather than rounded here: round with
            ``kv.astype(ml_dtypes.bfloat16)`` first, so it is plain which bf16 values the bytes
            stand for.

    Returns:
        uint8 ``[..., 656]`` in kv's library.
    """
    if kv.shape[-1:] != (HEAD_DIM_K,):
        raise ValueError(f"kv must be [..., {HEAD_DIM_K}] (a K row: 512 NoPE + 64 RoPE values); "
                         f"got shape {tuple(kv.shape)}")
    if kv.dtype.name != "bfloat16":
        raise TypeError(f"kv must be ml_dtypes.bfloat16 (round it with kv.astype(ml_dtypes.bfloat16)); "
                        f"got {kv.dtype}")
    xp = _array_module(kv)
    lead = tuple(kv.shape[:-1])
    nope = to_compute(kv[..., :HEAD_DIM_V])       # float32, exact
    tiles = nope.reshape(lead + (FP8_NUM_SCALES, FP8_QUANT_TILE))
    scales = _tile_scales(xp.abs(tiles).max(axis=-1), xp)                   # [..., 4]
    with np.errstate(invalid="ignore"):     # inf / inf in a tile that holds inf: NaN, as upstream
        codes = _float32_to_e4m3fn(tiles / scales[..., None], xp)         # exact: powers of two

    packed = xp.empty(lead + (FP8_TOKEN_BYTES,), dtype=xp.uint8)
    packed[..., :SCALES_OFFSET] = codes.reshape(lead + (HEAD_DIM_V,))
    packed[..., SCALES_OFFSET:ROPE_OFFSET] = scales.view(xp.uint8)
    packed[..., ROPE_OFFSET:] = xp.ascontiguousarray(kv[..., HEAD_DIM_V:]).view(xp.uint16).view(xp.uint8)
    return packed


def dequantize_fp8_sparse(packed, dtype=np.float32):
    """K rows from the 656-byte V3.2 FP8 layout.

    Args:
        packed: ``[..., 656]`` uint8 (int8 and ``ml_dtypes.float8_e4m3fn`` views are read as
            their bytes), NumPy or CuPy.
        dtype: of the result: ``float32`` (default), ``float64`` or ``ml_dtypes.bfloat16``.
            NoPE values are ``fp8 * scale`` computed in float32 (float64 for a float64 result),
            as upstream computes them, then rounded to ``dtype``. With the power-of-two scales
            that ``quantize_fp8_sparse`` writes, every result is exact in all three dtypes
            (an e4m3 value has 4 significant bits) -- except that a value of magnitude at least
            248 * 2**120 (about 3.3e38, near bf16's largest) quantizes to 256 * 2**120, which is
            inf outside float64.
            Upstream's ``dequantize_k_cache`` returns bfloat16: ask for it for its bytes.

    Returns:
        ``[..., 576]`` of ``dtype`` in packed's library.
    """
    name = np.dtype(dtype).name
    if name not in _DEQUANTIZED_DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(_DEQUANTIZED_DTYPES)}; got {name}")
    nope, scales, rope = split_fp8_sparse(packed)
    xp = _array_module(packed)
    compute = np.float64 if name == "float64" else np.float32
    lead = tuple(nope.shape[:-1])
    codes = nope.reshape(lead + (FP8_NUM_SCALES, FP8_QUANT_TILE))
    with np.errstate(invalid="ignore"):     # 0 * inf in a tile quantized from inf: NaN, as upstream
        values = xp.asarray(_E4M3FN_VALUES.astype(compute))[codes] * scales.astype(compute)[..., None]
    rope = _bfloat16_to_float64(rope, xp) if compute is np.float64 else to_compute(rope)
    k = xp.concatenate([values.reshape(lead + (HEAD_DIM_V,)), rope], axis=-1)
    return from_float32(k, dtype) if name == "bfloat16" else k


def split_fp8_sparse(packed):
    """The three parts of 656-byte tokens: ``(nope, scales, rope)``.

    Args:
        packed: ``[..., 656]`` uint8, int8 or ``ml_dtypes.float8_e4m3fn``, NumPy or CuPy.

    Returns:
        ``nope`` uint8 ``[..., 512]`` (the float8_e4m3fn codes; a view of packed), ``scales``
        float32 ``[..., 4]`` and ``rope`` ``ml_dtypes.bfloat16`` ``[..., 64]`` (copies).
    """
    if packed.shape[-1:] != (FP8_TOKEN_BYTES,):
        raise ValueError(f"packed must be [..., {FP8_TOKEN_BYTES}] (one 656-byte FP8 token per row); "
                         f"got shape {tuple(packed.shape)}")
    if packed.dtype.name not in BYTE_DTYPES:
        raise TypeError(f"packed must hold bytes (uint8, int8 or float8_e4m3fn); got {packed.dtype}")
    xp = _array_module(packed)
    packed = packed.view(xp.uint8)
    # Changing the item size needs a contiguous last axis: copy the two small parts.
    scales = xp.ascontiguousarray(packed[..., SCALES_OFFSET:ROPE_OFFSET]).view(xp.float32)
    rope = xp.ascontiguousarray(packed[..., ROPE_OFFSET:]).view(xp.uint16).view(np.dtype(ml_dtypes.bfloat16))
    return packed[..., :SCALES_OFFSET], scales, rope


def _bfloat16_to_float64(x, xp):
    """bf16 widened to float64 exactly, on CuPy too.

    CuPy compiles its kernels with ``-ftz=true``: a float32 subnormal becomes 0 when cast to
    float64 on the GPU. bf16 subnormals (exponent bits 0) are ``m * 2**-133``: computed in float64.
    """
    bits = xp.ascontiguousarray(x).view(xp.uint16)
    sign = xp.where(bits & 0x8000, -1.0, 1.0)
    subnormal = sign * (bits & 0x7F).astype(np.float64) * 2.0 ** -133
    return xp.where((bits & 0x7F80) == 0, subnormal, to_compute(x, np.float64))


def _tile_scales(amax, xp):
    """``2 ** ceil(log2(max(amax / 448, 1e-4)))`` for float32 ``amax``, exactly, in float32.

    The power of two comes from the bits, not from log2: ``bound`` is a normal float32 (at
    least 1e-4), so ``ceil(log2(bound))`` is its exponent, plus one unless its mantissa is 0.
    """
    bound = xp.maximum(amax / np.float32(E4M3_MAX), np.float32(MIN_SCALE_BOUND))   # NaN stays NaN
    bits = bound.view(xp.uint32)
    biased_exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0)
    scales = (biased_exponent << 23).astype(xp.uint32).view(xp.float32)
    return xp.where(xp.isfinite(bound), scales, bound)                 # inf and NaN as upstream


def _float32_to_e4m3fn(x, xp):
    """float8_e4m3fn codes (uint8) of float32 ``x``, rounded to nearest even.

    torch's conversion (c10's ``fp8e4m3fn_from_fp32_value``) in array code, no saturation:
    magnitudes over 464 (they round past 448), inf and NaN give NaN (0x7F with x's sign). Below
    2**-6 (e4m3's subnormals) adding 2**14 lets float32's own rounding drop the bits under 2**-9;
    above, the bits under e4m3's 3 mantissa bits are rounded off by hand.
    """
    bits = x.view(xp.uint32)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    smallest_normal = np.uint32(121 << 23)                             # the float32 2**-6
    subnormal_bias = np.uint32(141 << 23)                              # the float32 2**14
    small = xp.minimum(magnitude, smallest_normal).view(xp.float32)    # (no arithmetic on inf, NaN)
    subnormal = (small + subnormal_bias.view(np.float32)).view(xp.uint32) - subnormal_bias
    half_even = 0x7FFFF + ((magnitude >> 20) & 1)                      # just under half, or half if odd
    normal = (magnitude - np.uint32(120 << 23) + half_even) >> 20      # rebias 127 -> 7, keep 3 bits
    code = xp.where(magnitude >= np.uint32(1087 << 20), 0x7F,            # 480.0f
                    xp.where(magnitude < smallest_normal, subnormal, normal))
    return (code | sign).astype(xp.uint8)
