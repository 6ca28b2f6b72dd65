"""The minimal FlashAttention forward and manual attention (flashmla_cupy/attention.py).

CPU tests: argument checks (on CuPy array headers over a made-up address, tests/fake_arrays.py:
the checks read only shapes and dtypes and raise before anything touches a GPU), the parameter
struct against its C++ header, and the NVRTC compile with its ptxas report. GPU tests compare against the float64
``reference.attention``.

Tolerances for float32 against float64 (atol 2e-5, rtol 1e-4 on out; atol 2e-5, rtol 1e-5 on
lse): with standard-normal inputs a scaled score is O(1) and its float32 dot product of d <= 128
terms errs by about d * 2^-24 * scale <= 1e-6; an error e in a score changes its probability by
a factor exp(e) ~ 1 + e, so out (a convex combination of rows of V, |v| < 6) moves by well under
1e-5, and accumulating up to 1024 keys in float32 adds errors of the same order. lse = m + log l
inherits the same ~1e-6. The margins leave room for a factor of ten, not for a wrong mask or a
missed tile: those show up as errors of order 0.1.
"""
from __future__ import annotations

import ctypes
import types

import cupy
import numpy as np
import pytest

from conftest import nvrtc_skip_reason
from fake_arrays import HostCudaArrayInterface, HostDLPack, fake_array
from flashmla_cupy import attention, checks, compiler
from test_params import parse_structs

SHAPE = (2, 3, 5, 64)
OUT_TOL = dict(atol=2e-5, rtol=1e-4)
LSE_TOL = dict(atol=2e-5, rtol=1e-5)
BOTH = [attention.flash_attn_minimal, attention.manual_attention]


# --------------------------------------------------------------------------------------------
# Argument checks (CPU)
# --------------------------------------------------------------------------------------------

def qkv_with(name=None, value=None, shape=SHAPE):
    """Valid q, k, v headers of ``shape``, with argument ``name`` replaced by ``value``."""
    args = {n: fake_array(shape) for n in "qkv"}
    if name is not None:
        args[name] = value
    return args


def host_memory_only(monkeypatch):
    """Pointers resolve to host memory (a real GPU says so too for a NumPy array's memory)."""
    attributes = types.SimpleNamespace(type=cupy.cuda.runtime.memoryTypeUnregistered, device=-2)
    monkeypatch.setattr(cupy.cuda.runtime, "pointerGetAttributes", lambda address: attributes)


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("value, words", [
    (np.zeros(SHAPE, np.float32), "got a NumPy array in host memory"),
    (HostDLPack(1), "DLPack device type is 1"),
    (HostDLPack(3), "DLPack device type is 3"),
    (HostCudaArrayInterface(SHAPE, np.float32), "__cuda_array_interface__ points to host memory"),
    ([[1.0]], "got builtins.list"),
], ids=["numpy", "dlpack-cpu", "dlpack-cuda-host", "cuda-array-interface", "list"])
def test_rejects_non_device_arrays(fn, name, value, words, monkeypatch):
    host_memory_only(monkeypatch)
    with pytest.raises(TypeError, match=rf"^{name} must be a float32 GPU array \[B, H, N, d\]") as e:
        fn(**qkv_with(name, value))
    assert words in str(e.value)


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
def test_rejects_other_dtypes(fn, name, dtype):
    with pytest.raises(TypeError, match=rf"^{name} must have dtype float32; got {np.dtype(dtype).name}$"):
        fn(**qkv_with(name, fake_array(SHAPE, dtype)))


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(3, 5, 64), (1, 2, 3, 5, 64)])
def test_rejects_other_ranks(fn, name, shape):
    with pytest.raises(ValueError, match=rf"^{name} must be 4-D \[B, H, N, d\]; got {len(shape)}-D shape"):
        fn(**qkv_with(name, fake_array(shape)))


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("shape", [(2, 3, 6, 64), (2, 3, 5, 32), (1, 3, 5, 64), (2, 4, 5, 64)])
def test_rejects_shapes_unlike_q(fn, name, shape):
    with pytest.raises(ValueError, match=rf"^{name} must have q's shape") as e:
        fn(**qkv_with(name, fake_array(shape)))
    assert str(SHAPE) in str(e.value) and str(shape) in str(e.value)


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_rejects_arrays_on_another_device(fn, name, monkeypatch):
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    with pytest.raises(ValueError, match=rf"^{name} must be on CuPy's current device 0; got an array on device 1"):
        fn(**qkv_with(name, fake_array(SHAPE, device=1)))


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("axis, dim", list(enumerate("BHNd")))
def test_rejects_empty_dimensions(fn, axis, dim):
    shape = list(SHAPE)
    shape[axis] = 0
    with pytest.raises(ValueError, match=rf"^q, k, v: {dim} must be at least 1"):
        fn(**qkv_with(shape=tuple(shape)))


@pytest.mark.parametrize("d", [129, 256])
def test_flash_rejects_head_dims_over_128(d):
    with pytest.raises(ValueError, match=rf"^q, k, v: head dim d must be at most 128; got d={d}"):
        attention.flash_attn_minimal(**qkv_with(shape=(1, 1, 4, d)))


@pytest.mark.parametrize("shape", [(65536, 1, 1, 8), (1, 65536, 1, 8), (1, 1, 2**31, 1)])
def test_flash_rejects_sizes_past_the_grid(shape):
    with pytest.raises(ValueError, match=r"^q, k, v: flash_attn_minimal supports B <= 65535"):
        attention.flash_attn_minimal(**qkv_with(shape=shape))


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("causal", ["false", 1, None])
def test_rejects_causal_that_is_not_a_bool(fn, causal):
    with pytest.raises(TypeError, match=r"^causal must be a bool"):
        fn(**qkv_with(), causal=causal)


@pytest.mark.parametrize("fn", BOTH)
@pytest.mark.parametrize("scale, error", [
    ("0.1", TypeError), (True, TypeError), (1j, TypeError),
    (float("nan"), ValueError), (float("inf"), ValueError), (1e39, ValueError),
])
def test_rejects_bad_softmax_scale(fn, scale, error):
    with pytest.raises(error, match=r"^softmax_scale must be"):
        fn(**qkv_with(), softmax_scale=scale)


def test_head_dims_map_to_three_variants_within_48_kib():
    assert [attention.head_dim_tile(d) for d in (1, 32, 33, 64, 65, 128)] == [32, 32, 64, 64, 128, 128]
    assert max(attention.smem_bytes(d) for d in range(1, 129)) == 48 * 1024   # no opt-in needed


# --------------------------------------------------------------------------------------------
# Host and device agree on the parameters; the kernel compiles (CPU, NVRTC)
# --------------------------------------------------------------------------------------------

def test_params_struct_matches_device_header():
    header = (compiler.source_dir() / "attention" / "params.cuh").read_text()
    device_fields = parse_structs(header)["FlashAttnMinimalParams"]
    host_fields = attention.FlashAttnMinimalParams._fields_
    assert [n for _, n in device_fields] == [n for n, _ in host_fields], "field names or order differ"
    c_types = {"int": ctypes.c_int32, "float": ctypes.c_float}
    for (ctype, name), (_, host_type) in zip(device_fields, host_fields):
        expected = ctypes.c_uint64 if ctype.endswith("*") else c_types[ctype]
        assert host_type is expected, f"{name}: {ctype} on the device, {host_type} on the host"


@pytest.mark.nvrtc
def test_compiles_for_hopper_without_spills():
    cubin = compiler.compile_program(attention.PROGRAM, "sm_90a")
    print(f"\nflash_attn_minimal, sm_90a, {cubin.compile_seconds:.1f} s:")
    for name in attention.PROGRAM.kernels:
        res = cubin.resources[name]
        print(f"  {name}: {res}")
        assert res.registers > 0, f"{name}: no ptxas report"
        assert (res.stack_bytes, res.spill_stores, res.spill_loads) == (0, 0, 0), f"{name}: {res}"
        # 128 threads x 128 registers: 4 CTAs (16 warps) still fit in an SM's register file.
        assert res.registers <= 128, f"{name}: {res}"


def _supported_archs() -> list[str]:
    if nvrtc_skip_reason() is not None:        # parametrized at collection: the marker acts later
        return []
    archs = compiler._nvrtc().getSupportedArchs()
    return [f"sm_{min(archs)}", "sm_80", f"sm_{max(archs)}"]


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", _supported_archs())
def test_compiles_for_other_archs(arch):
    # Plain CUDA: whatever GPU CuPy runs on, driver.device_arch's target must compile.
    cubin = compiler.compile_program(attention.PROGRAM, arch)
    assert set(cubin.lowered) == set(attention.PROGRAM.kernels)


# --------------------------------------------------------------------------------------------
# Results (GPU)
# --------------------------------------------------------------------------------------------

def random_qkv(shape, seed):
    gen = np.random.default_rng(seed)
    return tuple(cupy.asarray(gen.standard_normal(shape, dtype=np.float32)) for _ in range(3))


def poison_pool(*shapes):
    """Leave float32 blocks of these shapes, full of NaN, in CuPy's memory pool: the outputs the
    function allocates next most likely reuse them, so an element it fails to write stays NaN."""
    for shape in shapes:
        cupy.full(shape, np.nan, dtype=np.float32)   # freed at once, kept by the pool


def check_against_reference(q, k, v, causal, softmax_scale=None):
    from flashmla_cupy import reference

    batch, heads, seqlen, _ = q.shape
    poison_pool(q.shape, (batch, heads, seqlen))
    out, lse = attention.flash_attn_minimal(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                            return_lse=True)
    assert out.shape == q.shape and out.dtype == np.float32
    assert lse.shape == (batch, heads, seqlen) and lse.dtype == np.float32
    assert bool(cupy.isfinite(out).all()) and bool(cupy.isfinite(lse).all())
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    np.testing.assert_allclose(cupy.asnumpy(out), cupy.asnumpy(ref_out), **OUT_TOL)
    np.testing.assert_allclose(cupy.asnumpy(lse), cupy.asnumpy(ref_lse), **LSE_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("seqlen", [1, 31, 32, 33, 64, 100, 1024])
def test_matches_reference(seqlen, d, causal):
    q, k, v = random_qkv((2, 3, seqlen, d), seed=seqlen * 1000 + d * 2 + causal)
    check_against_reference(q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(3, 5, 77, 1), (1, 2, 45, 17), (2, 1, 200, 40), (1, 3, 129, 96),
                                   (2, 2, 33, 127), (1, 1, 1, 128), (5, 7, 3, 63)])
def test_matches_reference_odd_shapes(shape, causal):
    q, k, v = random_qkv(shape, seed=sum(shape) + causal)
    check_against_reference(q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softmax_scale", [0.3, -0.1, 0.0])
def test_softmax_scale(softmax_scale, causal):
    q, k, v = random_qkv((2, 2, 70, 64), seed=7)
    check_against_reference(q, k, v, causal, softmax_scale)


@pytest.mark.gpu
def test_seed_configuration_matches_manual_attention():
    # The tutorial's comparison: batch 16, 12 heads, seq 64, head dim 64.
    q, k, v = random_qkv((16, 12, 64, 64), seed=0)
    check_against_reference(q, k, v, causal=False)
    np.testing.assert_allclose(cupy.asnumpy(attention.flash_attn_minimal(q, k, v)),
                               cupy.asnumpy(attention.manual_attention(q, k, v)), **OUT_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_two_runs_are_bitwise_equal(causal):
    q, k, v = random_qkv((2, 3, 300, 64), seed=11)
    out1, lse1 = attention.flash_attn_minimal(q, k, v, causal=causal, return_lse=True)
    out2, lse2 = attention.flash_attn_minimal(q, k, v, causal=causal, return_lse=True)
    assert bool((out1 == out2).all()) and bool((lse1 == lse2).all())


@pytest.mark.gpu
def test_non_contiguous_inputs_give_the_contiguous_result():
    q, k, v = random_qkv((2, 50, 3, 64), seed=13)                        # [B, N, H, d]
    views = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]                  # [B, H, N, d] views
    assert not views[0].flags.c_contiguous
    expected = attention.flash_attn_minimal(*(cupy.ascontiguousarray(x) for x in views), causal=True)
    assert bool((attention.flash_attn_minimal(*views, causal=True) == expected).all())


class CudaArrayInterface:
    def __init__(self, array):
        self.__cuda_array_interface__ = array.__cuda_array_interface__


class CudaDLPack:
    def __init__(self, array):
        self._array = array

    def __dlpack__(self, stream=None, **kwargs):
        return self._array.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


@pytest.mark.gpu
@pytest.mark.parametrize("wrapper", [CudaArrayInterface, CudaDLPack])
def test_foreign_device_arrays_are_taken_without_copy(wrapper):
    q, k, v = random_qkv((1, 2, 40, 32), seed=17)
    assert checks.device_view(wrapper(q), "q").data.ptr == q.data.ptr
    expected = attention.flash_attn_minimal(q, k, v)
    assert bool((attention.flash_attn_minimal(wrapper(q), wrapper(k), wrapper(v)) == expected).all())


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    q, k, v = random_qkv((2, 2, 100, 64), seed=19)
    expected = attention.flash_attn_minimal(q, k, v)
    with cupy.cuda.Stream(non_blocking=True) as stream:
        out = attention.flash_attn_minimal(q, k, v)
        stream.synchronize()
    assert bool((out == expected).all())


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 1, 64), (2, 3, 100, 64), (1, 2, 33, 256)])
def test_manual_attention_matches_reference(shape, causal):
    # Float32 cuBLAS matmuls (CuPy uses no TF32 unless CUPY_TF32=1 is set).
    from flashmla_cupy import reference

    q, k, v = random_qkv(shape, seed=23 + causal)
    out = attention.manual_attention(q, k, v, causal=causal, softmax_scale=0.1)
    ref_out, _ = reference.attention(q, k, v, causal=causal, softmax_scale=0.1)
    assert out.shape == q.shape and out.dtype == np.float32
    np.testing.assert_allclose(cupy.asnumpy(out), cupy.asnumpy(ref_out), **OUT_TOL)
