"""CPU tests of DeepSeek-V3.2's FP8 KV-cache layout (flashmla_cupy/quant.py).

The bytes must be FlashMLA's (tests/quant.py upstream), bit for bit. They are compared with a
transcription of upstream's formula written here one tile at a time with NumPy float32 scalars,
log2 and ceil (``upstream_quantize``), with ``math.frexp`` for the scales of every bf16 amax, with
``ml_dtypes``' float8_e4m3fn cast for every bf16 value up to 448, with codes worked out by hand,
and -- where torch is installed -- with upstream's torch code itself. Each test has its own fixed
seed.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from flashmla_cupy import quant
from flashmla_cupy.constants import FP8_TOKEN_BYTES, HEAD_DIM_K

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def bf16(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(BF16)


def bf16_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(BF16)


def random_rows(rng, shape, low_exp=-20, high_exp=20) -> np.ndarray:
    """bf16 K rows whose 4 NoPE tiles and RoPE part each get a random power-of-two magnitude."""
    exponents = rng.integers(low_exp, high_exp, shape + (5,))
    magnitudes = 2.0 ** np.repeat(exponents, [128, 128, 128, 128, 64], axis=-1)
    return (rng.standard_normal(shape + (HEAD_DIM_K,)) * magnitudes).astype(np.float32).astype(BF16)


def upstream_quantize(row) -> np.ndarray:
    """One bf16 row [576] -> 656 bytes, as upstream's quantize_k_cache (V32 branch) computes it.

    Written like its torch code: per tile, ``abs().max().float() / 448.0``, ``clamp_min(1e-4)``,
    ``log2().ceil()``, ``pow(2, .)`` in float32, then ``(x.float() / scale).to(float8_e4m3fn)``.
    """
    x = row.astype(np.float32)
    codes, scales = [], []
    for tile in range(4):
        values = x[128 * tile:128 * (tile + 1)]
        bound = np.maximum(np.abs(values).max() / np.float32(448.0), np.float32(1e-4))
        scale = np.power(np.float32(2), np.ceil(np.log2(bound)))
        assert scale.dtype == np.float32
        codes.append((values / scale).astype(E4M3).view(np.uint8))
        scales.append(scale)
    return np.concatenate(codes + [np.array(scales, np.float32).view(np.uint8), row[512:].view(np.uint8)])


def scale_by_frexp(amax) -> float:
    """2 ** ceil(log2(max(amax / 448, 1e-4))) with float32 division, through math.frexp."""
    bound = float(max(np.float32(amax) / np.float32(448.0), np.float32(1e-4)))
    mantissa, exponent = math.frexp(bound)          # bound = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)


def e4m3_by_formula(code: int) -> float:
    """The value of a float8_e4m3fn code from its fields (bias 7, no infinities, NaN = S.1111.111)."""
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 15 and mantissa == 7:
        return math.nan
    if exponent == 0:
        return sign * mantissa * 2.0 ** -9
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def tile_rows(tiles) -> np.ndarray:
    """Rows of 4 given 128-value tiles each (float32 lists), with a random RoPE part, as bf16."""
    rng = np.random.default_rng(7)
    tiles = np.asarray(tiles, dtype=np.float32).reshape(-1, 4, 128)
    rope = rng.standard_normal((len(tiles), 64)).astype(np.float32)
    return np.concatenate([tiles.reshape(-1, 512), rope], axis=1).astype(BF16)


def tile(*values, fill=0.0):
    """A 128-value tile that starts with ``values`` and holds ``fill`` elsewhere."""
    t = np.full(128, fill, dtype=np.float32)
    t[:len(values)] = values
    return t


# --------------------------------------------------------------------------------------------
# The layout and the round trip
# --------------------------------------------------------------------------------------------

def test_round_trip_within_e4m3_precision():
    rng = np.random.default_rng(101)
    kv = random_rows(rng, (5, 16, 1), low_exp=-30, high_exp=30)
    kv[0, 0, 0, :128] = bf16(rng.standard_normal(128) * 1e-39)      # bf16 subnormals: scale 2**-13
    packed = quant.quantize_fp8_sparse(kv)
    assert packed.dtype == np.uint8 and packed.shape == (5, 16, 1, FP8_TOKEN_BYTES)

    nope, scales, rope = quant.split_fp8_sparse(packed)
    assert nope.shape == (5, 16, 1, 512) and scales.shape == (5, 16, 1, 4) and rope.shape == (5, 16, 1, 64)
    np.testing.assert_array_equal(rope.view(np.uint16), kv[..., 512:].view(np.uint16))
    mantissas, _ = np.frexp(scales)
    assert (mantissas == 0.5).all() and (scales >= 2.0 ** -13).all()    # powers of two, floor 2**-13

    x = kv.astype(np.float32)
    got = quant.dequantize_fp8_sparse(packed)
    assert got.dtype == np.float32 and got.shape == kv.shape
    np.testing.assert_array_equal(got[..., 512:], x[..., 512:])        # RoPE as it was
    # Rounding to e4m3 (3 mantissa bits) moves a value by at most half a unit in its last place:
    # 2**-4 of it in the normal range, 2**-10 of the scale among e4m3's subnormals.
    err = np.abs(got[..., :512] - x[..., :512]).reshape(5, 16, 1, 4, 128)
    bound = np.maximum(np.abs(x[..., :512]).reshape(err.shape) * 2.0 ** -4, scales[..., None] * 2.0 ** -10)
    assert (err <= bound).all()
    # Not a trivially passing zero result: above the 2**-13 floor, hardly a value rounds to 0.
    above_floor = np.broadcast_to(scales[..., None] > 2.0 ** -13, err.shape)
    assert above_floor.mean() > 0.3
    assert (got[..., :512].reshape(err.shape)[above_floor] != 0).mean() > 0.99


def test_dequantized_dtypes_agree_and_are_exact():
    rng = np.random.default_rng(102)
    packed = quant.quantize_fp8_sparse(random_rows(rng, (3, 64, 1)))
    f32 = quant.dequantize_fp8_sparse(packed)
    f64 = quant.dequantize_fp8_sparse(packed, np.float64)
    b16 = quant.dequantize_fp8_sparse(packed, ml_dtypes.bfloat16)
    assert f64.dtype == np.float64 and b16.dtype == BF16
    np.testing.assert_array_equal(f64, f32)               # fp8 * power of two: exact in float32 ...
    np.testing.assert_array_equal(b16.astype(np.float32), f32)   # ... and in bfloat16 (upstream's dtype)
    # int8 and float8_e4m3fn views of the same bytes read the same
    np.testing.assert_array_equal(quant.dequantize_fp8_sparse(packed.view(np.int8)), f32)
    np.testing.assert_array_equal(quant.dequantize_fp8_sparse(packed.view(E4M3)), f32)


def test_paged_cache_and_single_row_shapes():
    rng = np.random.default_rng(103)
    cache = random_rows(rng, (7, 53, 1))                                    # [num_blocks, page, 1, 576]
    packed = quant.quantize_fp8_sparse(cache)
    assert packed.shape == (7, 53, 1, 656)
    # A row is quantized on its own: the paged result is the rows' results.
    np.testing.assert_array_equal(packed.reshape(-1, 656), quant.quantize_fp8_sparse(cache.reshape(-1, 576)))
    np.testing.assert_array_equal(packed[3, 5, 0], quant.quantize_fp8_sparse(cache[3, 5, 0]))
    assert quant.dequantize_fp8_sparse(packed).shape == (7, 53, 1, 576)
    # A non-contiguous input (every other token) gives the same bytes as its copy.
    np.testing.assert_array_equal(quant.quantize_fp8_sparse(cache[:, ::2]), packed[:, ::2])


def every_bf16_as_rope(rng) -> np.ndarray:
    """Packed tokens whose RoPE parts hold all 65536 bf16 bit patterns, NoPE parts random."""
    packed = quant.quantize_fp8_sparse(random_rows(rng, (1024,)))
    packed[:, 528:] = np.arange(2**16, dtype=np.uint32).astype(np.uint16).reshape(1024, 64).view(np.uint8)
    return packed


def test_every_bf16_rope_value_comes_back_exactly():
    packed = every_bf16_as_rope(np.random.default_rng(111))
    rope = packed[:, 528:].view(BF16)
    with np.errstate(invalid="ignore"):                          # casting signaling NaNs
        for dtype in (np.float32, np.float64):
            got = quant.dequantize_fp8_sparse(packed, dtype)[:, 512:]
            want = rope.astype(dtype)
            np.testing.assert_array_equal(got, want)             # NaN where NaN
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    got = quant.dequantize_fp8_sparse(packed, ml_dtypes.bfloat16)[:, 512:]
    nan = np.isnan(rope.astype(np.float32))
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], rope.view(np.uint16)[~nan])
    assert np.isnan(got.astype(np.float32)[nan]).all()


def test_every_fp8_code_dequantizes_by_the_formula():
    rng = np.random.default_rng(104)
    packed = quant.quantize_fp8_sparse(random_rows(rng, (3,)))
    packed[:, :512] = np.arange(512) % 256                   # every code in each tile half
    powers = np.array([[1.0, 2.0 ** -13, 2.0 ** 20, 0.5]] * 3, np.float32)
    packed[:, 512:528] = powers.view(np.uint8)
    got = quant.dequantize_fp8_sparse(packed, np.float64)[:, :512].reshape(3, 4, 128)
    want = np.array([e4m3_by_formula(c) for c in np.arange(512) % 256]).reshape(4, 128) * powers[0, :, None]
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))   # NaN at 0x7F and 0xFF


# --------------------------------------------------------------------------------------------
# The scale rule and the rounding, case by case
# --------------------------------------------------------------------------------------------

# (tile, expected scale): amax exactly 448 * 2**k, one bf16 step above and below it, the 1e-4
# floor, zeros, negative values.
SCALE_CASES = [
    (tile(448.0), 1.0),
    (tile(450.0), 2.0),                                  # the bf16 after 448
    (tile(446.0), 1.0),                                  # the bf16 before 448
    (tile(-448.0 * 8), 8.0),
    (tile(448.0 * 2 ** 100, -3.0), 2.0 ** 100),
    (tile(1.0, -448.0 * 2 ** -7), 2.0 ** -7),
    (tile(448.0 * 2 ** -13), 2.0 ** -13),                # bound exactly 2**-13
    (tile(float(bf16_from_bits(0x3D61).astype(np.float32))), 2.0 ** -12),   # the bf16 after 448 * 2**-13
    (tile(448.0 * 2 ** -14), 2.0 ** -13),                # bound 2**-14 < 1e-4: the floor
    (tile(0.0448), 2.0 ** -13),                          # bound about 1e-4
    (tile(1e-6, -3e-7), 2.0 ** -13),
    (tile(), 2.0 ** -13),                                # all zeros
    (tile(-2.5, fill=-1.0), 2.0 ** -7),                  # 2.5 / 448 is in (2**-8, 2**-7]
]


def test_scale_rule_on_hand_made_tiles():
    tiles = [t for t, _ in SCALE_CASES]
    tiles += [tile()] * (-len(tiles) % 4)
    packed = quant.quantize_fp8_sparse(tile_rows(tiles))
    _, scales, _ = quant.split_fp8_sparse(packed)
    got = scales.reshape(-1)[:len(SCALE_CASES)]
    np.testing.assert_array_equal(got, np.array([s for _, s in SCALE_CASES], np.float32))
    for t, s in SCALE_CASES:
        assert s == scale_by_frexp(np.abs(t.astype(BF16).astype(np.float32)).max())


# (value, its code) in a tile whose amax is 448, so that the scale is 1 and value / scale = value.
ROUNDING_CASES = [
    (448.0, 0x7E), (-448.0, 0xFE), (1.0, 0x38), (0.0, 0x00), (-0.0, 0x80),
    (1.0625, 0x38),          # tie between 1 (0x38) and 1.125 (0x39): the even one
    (1.1875, 0x3A),          # tie between 1.125 (0x39) and 1.25 (0x3A): the even one
    (-1.1875, 0xBA),
    (432.0, 0x7E),           # tie between 416 (0x7D) and 448 (0x7E)
    (424.0, 0x7D), (440.0, 0x7E),
    (2.0 ** -6, 0x08),       # the smallest normal
    (15 * 2.0 ** -10, 0x08),  # tie between 7 * 2**-9 (0x07) and 2**-6 (0x08)
    (2.0 ** -9, 0x01),       # the smallest subnormal
    (2.0 ** -10, 0x00),      # tie between 0 and 2**-9: zero
    (3 * 2.0 ** -10, 0x02),  # tie between 2**-9 (0x01) and 2 * 2**-9 (0x02)
    (5 * 2.0 ** -10, 0x02),  # tie between 0x02 and 0x03
    (-(2.0 ** -11), 0x80),   # rounds to -0
    (2.0 ** -20, 0x00),
]


def test_rounding_on_hand_made_values():
    values = np.array([v for v, _ in ROUNDING_CASES], np.float32)
    t = tile(448.0, *values)
    packed = quant.quantize_fp8_sparse(tile_rows([t, t, t, t])[0])
    assert packed[512:516].view(np.float32)[0] == 1.0
    np.testing.assert_array_equal(packed[1:1 + len(values)], [c for _, c in ROUNDING_CASES])
    np.testing.assert_array_equal(values.astype(E4M3).view(np.uint8), [c for _, c in ROUNDING_CASES])


def test_every_bf16_up_to_448_rounds_as_ml_dtypes_casts():
    """With scale 1 the code of x is float8_e4m3fn(x): every bf16 value of magnitude <= 448."""
    bits = np.arange(0x43E1, dtype=np.uint16)                    # 0 .. 448, every bf16 value
    values = np.concatenate([bits, bits | 0x8000]).view(BF16).astype(np.float32)
    values = np.concatenate([values, np.zeros(-len(values) % 127, np.float32)]).reshape(-1, 127)
    tiles = np.concatenate([np.full((len(values), 1), 448.0, np.float32), values], axis=1)   # amax 448
    tiles = np.concatenate([tiles, np.tile(tiles[:1], (-len(tiles) % 4, 1))])
    packed = quant.quantize_fp8_sparse(tile_rows(tiles))
    _, scales, _ = quant.split_fp8_sparse(packed)
    assert (scales == 1.0).all()
    codes = packed[:, :512].reshape(-1, 128)[:len(values), 1:]
    np.testing.assert_array_equal(codes, values.astype(E4M3).view(np.uint8))


def test_scale_of_every_bf16_amax():
    """Each positive finite bf16 value as a tile's amax: the scale of upstream's formula."""
    rng = np.random.default_rng(105)
    amax = bf16_from_bits(np.arange(1, 0x7F80)).astype(np.float32)       # 2**-133 .. bf16's largest
    amax = np.concatenate([amax, amax[-1:].repeat(-len(amax) % 4)])
    tiles = amax[:, None] * rng.uniform(-1, 1, (len(amax), 128)).astype(np.float32)
    tiles[:, 0] = amax                                                   # |others| <= amax after rounding
    packed = quant.quantize_fp8_sparse(tile_rows(tiles))
    _, scales, _ = quant.split_fp8_sparse(packed)
    got = scales.reshape(-1)
    by_log2 = np.power(np.float32(2), np.ceil(np.log2(np.maximum(amax / np.float32(448), np.float32(1e-4)))))
    np.testing.assert_array_equal(got, by_log2)
    np.testing.assert_array_equal(got, [scale_by_frexp(a) for a in amax])


def test_bytes_match_upstream_formula_on_random_and_extreme_rows():
    rng = np.random.default_rng(106)
    rows = [random_rows(rng, (96,), low_exp=-140, high_exp=122),        # bf16 subnormals to ~2**124
            random_rows(rng, (32,), low_exp=-8, high_exp=8)]
    hand = tile_rows([t for t, _ in SCALE_CASES] + [tile(448.0, *[v for v, _ in ROUNDING_CASES])] * 2
                     + [tile(np.inf, 1.0, -2.0)])                       # an inf tile: 0 and NaN codes
    packed = [quant.quantize_fp8_sparse(r) for r in rows + [hand]]
    with np.errstate(invalid="ignore"):                                 # inf / inf
        for got, kv in zip(packed, rows + [hand]):
            want = np.stack([upstream_quantize(row) for row in kv])
            np.testing.assert_array_equal(got, want)


def test_non_finite_tiles_dequantize_to_nan_and_leave_the_rest():
    rng = np.random.default_rng(107)
    kv = random_rows(rng, (3,))
    kv[0, 5] = bf16(np.inf)
    kv[1, 130] = bf16(-np.inf)
    kv[2, 300] = bf16(np.nan)
    got = quant.dequantize_fp8_sparse(quant.quantize_fp8_sparse(kv))
    broken = np.zeros((3, 576), bool)
    broken[0, :128] = broken[1, 128:256] = broken[2, 256:384] = True
    assert np.isnan(got[broken]).all()
    clean = quant.dequantize_fp8_sparse(quant.quantize_fp8_sparse(np.where(broken, bf16(1.0), kv)))
    np.testing.assert_array_equal(got[~broken], clean[~broken])


# --------------------------------------------------------------------------------------------
# Argument errors
# --------------------------------------------------------------------------------------------

def test_bad_arguments():
    kv = random_rows(np.random.default_rng(108), (2,))
    packed = quant.quantize_fp8_sparse(kv)
    with pytest.raises(ValueError, match=r"kv must be \[\.\.\., 576\]"):
        quant.quantize_fp8_sparse(kv[:, :575])
    with pytest.raises(TypeError, match="kv must be ml_dtypes.bfloat16.*float32"):
        quant.quantize_fp8_sparse(kv.astype(np.float32))
    with pytest.raises(TypeError, match="kv must be ml_dtypes.bfloat16.*int16"):
        quant.quantize_fp8_sparse(kv.view(np.int16))
    with pytest.raises(ValueError, match=r"packed must be \[\.\.\., 656\]"):
        quant.dequantize_fp8_sparse(packed[:, :655])
    with pytest.raises(TypeError, match="packed must hold bytes.*float32"):
        quant.dequantize_fp8_sparse(packed.astype(np.float32))
    with pytest.raises(TypeError, match="dtype must be one of float32, float64, bfloat16; got float16"):
        quant.dequantize_fp8_sparse(packed, np.float16)
    with pytest.raises(ValueError, match="packed must be"):
        quant.split_fp8_sparse(packed[:, :600])


# --------------------------------------------------------------------------------------------
# The same bytes from CuPy arrays, and from upstream's torch code
# --------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cupy_arrays_give_the_numpy_bytes():
    import cupy
    rng = np.random.default_rng(109)
    kv = np.concatenate([random_rows(rng, (4, 64, 1), low_exp=-140, high_exp=122).reshape(-1, 576),
                         tile_rows([t for t, _ in SCALE_CASES] + [tile(448.0, *[v for v, _ in ROUNDING_CASES])] * 3)])
    want = quant.quantize_fp8_sparse(kv)
    got = quant.quantize_fp8_sparse(cupy.asarray(kv.view(np.uint16)).view(BF16))
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(got), want)

    packed = np.concatenate([want, every_bf16_as_rope(rng)])
    for dtype in (np.float32, np.float64, ml_dtypes.bfloat16):
        back = quant.dequantize_fp8_sparse(cupy.asarray(packed), dtype)
        assert isinstance(back, cupy.ndarray) and back.dtype == np.dtype(dtype)
        with np.errstate(invalid="ignore"):                # casting signaling NaNs
            back = cupy.asnumpy(back).astype(np.float64)   # NaN payloads may differ: compare values
            host = quant.dequantize_fp8_sparse(packed, dtype).astype(np.float64)
        np.testing.assert_array_equal(back, host)
        numbers = ~np.isnan(host)
        np.testing.assert_array_equal(np.signbit(back[numbers]), np.signbit(host[numbers]))   # -0.0 too


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_upstream_torch_code_gives_the_same_bytes(device):
    """Upstream's quantize_k_cache (V32 branch) and dequantize_k_cache, line for line, in torch."""
    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    rng = np.random.default_rng(110)
    kv = np.concatenate([random_rows(rng, (256,), low_exp=-140, high_exp=122),
                         tile_rows([t for t, _ in SCALE_CASES] + [tile(448.0, *[v for v, _ in ROUNDING_CASES])] * 3)])
    x = torch.from_numpy(kv.view(np.int16).copy()).view(torch.bfloat16).to(device)       # [n, 576]
    result = torch.empty((len(kv), 656), dtype=torch.float8_e4m3fn, device=device)
    result_scales = result[..., 512:528].view(torch.float32)
    result[..., 528:].view(torch.bfloat16)[:] = x[..., 512:]
    for t in range(4):
        scale_inv = torch.abs(x[..., t * 128:(t + 1) * 128]).max(dim=-1).values.float() / 448.0
        scale_inv = torch.pow(2, torch.clamp_min(scale_inv, 1e-4).log2().ceil()).to(torch.float32)
        result_scales[:, t] = scale_inv
        result[..., t * 128:(t + 1) * 128] = (x[..., t * 128:(t + 1) * 128].float() / scale_inv.unsqueeze(-1)).to(torch.float8_e4m3fn)
    torch_bytes = result.view(torch.uint8).cpu().numpy()
    np.testing.assert_array_equal(quant.quantize_fp8_sparse(kv), torch_bytes)

    back = torch.empty((len(kv), 576), dtype=torch.bfloat16, device=device)
    back[..., 512:] = result[..., 528:].view(torch.bfloat16)
    for t in range(4):
        back[..., t * 128:(t + 1) * 128] = result[..., t * 128:(t + 1) * 128].to(torch.float32) * result_scales[..., t:t + 1]
    np.testing.assert_array_equal(quant.dequantize_fp8_sparse(torch_bytes, ml_dtypes.bfloat16).view(np.uint16),
                                  back.view(torch.int16).cpu().numpy().view(np.uint16))


# --------------------------------------------------------------------------------------------
# The dense FP8 cache: one scale per tensor
# --------------------------------------------------------------------------------------------

def test_per_tensor_round_trip_within_half_an_e4m3_step():
    rng = np.random.default_rng(111)
    for dtype in (BF16, np.float16, np.float32):
        x = (rng.standard_normal((3, 16, 2, 576)) * 2.0 ** rng.integers(-12, 12, (3, 16, 2, 1))).astype(dtype)
        codes, scale = quant.quantize_fp8_per_tensor(x)
        assert codes.dtype == np.uint8 and codes.shape == x.shape and scale.dtype == np.float32 and scale.shape == ()
        x32 = x.astype(np.float32)
        assert scale == np.abs(x32).max() / np.float32(448)
        values = quant._E4M3FN_VALUES[codes]
        assert np.abs(values).max() == 448                  # the largest magnitude lands on e4m3's largest
        np.testing.assert_array_equal(codes.view(E4M3), np.clip(x32 / scale, -448, 448).astype(E4M3))
        back = quant.dequantize_fp8_per_tensor(codes, scale, np.float64)
        # Half a step of e4m3 (3 mantissa bits) above its smallest normal 2**-6, half of 2**-9 below.
        bound = np.maximum(np.abs(x32 / scale) * 2.0 ** -4, 2.0 ** -10) * scale * (1 + 1e-6)
        assert (np.abs(back - x32.astype(np.float64)) <= bound).all()


def test_per_tensor_given_scale_saturates_and_zero_tensor_gets_scale_one():
    x = np.array([-1000.0, -448.0, -1.0, 0.0, 3 * 2.0 ** -11, 3.0, 500.0], dtype=np.float32)
    codes, scale = quant.quantize_fp8_per_tensor(x, scale=0.5)
    assert scale == np.float32(0.5)
    np.testing.assert_array_equal(quant._E4M3FN_VALUES[codes], [-448, -448, -2, 0, 2.0 ** -8, 6, 448])   # 1.5 steps: even
    codes, scale = quant.quantize_fp8_per_tensor(np.zeros((4, 576), np.float32))
    assert scale == 1 and not codes.any()
    for dtype in (np.float32, np.float64, ml_dtypes.bfloat16):
        back = quant.dequantize_fp8_per_tensor(np.array([0x7F, 0x38, 0xB8], np.uint8), np.float32(0.25), dtype)
        assert back.dtype == np.dtype(dtype)
        assert np.isnan(back.astype(np.float64)[0]) and back.astype(np.float64)[1:].tolist() == [0.25, -0.25]


def test_per_tensor_bad_arguments():
    x = np.ones((2, 576), np.float32)
    with pytest.raises(TypeError, match="x must be ml_dtypes.bfloat16, float16 or float32; got float64"):
        quant.quantize_fp8_per_tensor(x.astype(np.float64))
    with pytest.raises(ValueError, match="x must be finite"):
        quant.quantize_fp8_per_tensor(np.array([1.0, np.inf], np.float32))
    for bad in (0.0, -1.0, math.inf, math.nan, 1e-50):
        with pytest.raises(ValueError, match="scale must be positive and finite in float32"):
            quant.quantize_fp8_per_tensor(x, scale=bad)
    with pytest.raises(TypeError, match="scale must be a number or None; got str"):
        quant.quantize_fp8_per_tensor(x, scale="1")
    with pytest.raises(TypeError, match="codes must hold bytes"):
        quant.dequantize_fp8_per_tensor(x, 1.0)
    with pytest.raises(TypeError, match="dtype must be one of"):
        quant.dequantize_fp8_per_tensor(np.zeros(3, np.uint8), 1.0, np.float16)


@pytest.mark.gpu
def test_per_tensor_cupy_arrays_give_the_numpy_codes():
    import cupy
    x = (np.random.default_rng(112).standard_normal((64, 2, 576)) * 3).astype(np.float32).astype(BF16)
    want, want_scale = quant.quantize_fp8_per_tensor(x)
    got, scale = quant.quantize_fp8_per_tensor(cupy.asarray(x.view(np.uint16)).view(BF16))
    assert isinstance(got, cupy.ndarray) and float(scale) == float(want_scale)
    np.testing.assert_array_equal(cupy.asnumpy(got), want)
    np.testing.assert_array_equal(cupy.asnumpy(quant.dequantize_fp8_per_tensor(got, scale, np.float64)),
                                  quant.dequantize_fp8_per_tensor(want, want_scale, np.float64))
