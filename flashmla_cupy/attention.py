"""Minimal FlashAttention forward (float32) and the "manual attention" baseline it is measured against.

Both compute, per batch entry and head, ``softmax(softmax_scale * Q K^T) V`` on ``[B, H, N, d]``
float32 CuPy arrays (the causal mask lets query ``i`` see keys ``j <= i`` only):

* :func:`flash_attn_minimal` runs ``cuda_src/attention/flash_attn_minimal.cu``: tiles of 32 query
  rows and 32 keys in shared memory, online softmax, no ``N x N`` matrix in global memory. The
  toolkit's teaching kernel: plain CUDA (any GPU CuPy supports), correct for every ``N >= 1`` and
  ``1 <= d <= 128``, not tuned for speed.
* :func:`manual_attention` spells the same thing out in CuPy (matmul, softmax, matmul), writing
  the ``[B, H, N, N]`` scores to global memory, as the tutorial's baseline does.

Inputs: CuPy arrays, or any object that exposes device memory through ``__cuda_array_interface__``
or ``__dlpack__`` (taken without a copy). Non-contiguous inputs are accepted and copied to
contiguous ones first (one extra read and write of the input; pass contiguous arrays to avoid
it). Both functions run on CuPy's current device and current stream.
"""
from __future__ import annotations

import ctypes
import math

import cupy
import numpy as np

from . import checks, launch
from .compiler import Program

MAX_HEAD_DIM = 128
BLOCK_M = 32                      # query rows per CTA: kBlockM in the kernel
THREADS = 128                     # kThreads in the kernel
HEAD_DIM_TILES = (32, 64, 128)    # compiled variants; d is rounded up to the next one
MAX_GRID_YZ = 65535               # CUDA's limit on gridDim.y (heads) and gridDim.z (batch)
MAX_SEQLEN = 2**31 - BLOCK_M      # row indices reach N + 31 in the kernel's int32 arithmetic


class FlashAttnMinimalParams(ctypes.Structure):
    """Host mirror of ``FlashAttnMinimalParams`` in ``cuda_src/attention/params.cuh``."""
    _fields_ = [
        ("q", ctypes.c_uint64),
        ("k", ctypes.c_uint64),
        ("v", ctypes.c_uint64),
        ("out", ctypes.c_uint64),
        ("lse", ctypes.c_uint64),
        ("heads", ctypes.c_int32),
        ("seqlen", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("causal", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float),
    ]


PROGRAM = Program(
    name="flash_attn_minimal",
    source="attention/flash_attn_minimal.cu",
    kernels=tuple(f"flashmla::flash_attn_minimal_kernel<{t}>" for t in HEAD_DIM_TILES),
    defines=(("FLASHMLA_ATTN_MINIMAL_PARAMS_BYTES", str(ctypes.sizeof(FlashAttnMinimalParams))),),
)



def all_programs() -> list[Program]:
    """Every program of this module (for ahead-of-time builds: ``flashmla-cupy compile``)."""
    return [PROGRAM]

def head_dim_tile(head_dim: int) -> int:
    """The compiled variant serving ``head_dim``: the smallest tile width that holds it."""
    return next(t for t in HEAD_DIM_TILES if head_dim <= t)


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of one CTA: the Q, K and V tiles (at most 48 KiB, so no opt-in)."""
    return 3 * BLOCK_M * head_dim_tile(head_dim) * 4


def flash_attn_minimal(q, k, v, causal=False, softmax_scale=None, return_lse=False):
    """Attention forward with the minimal FlashAttention kernel.

    Args:
        q, k, v: float32 device arrays ``[B, H, N, d]`` of one shape, ``1 <= d <= 128``,
            ``1 <= B, H <= 65535``, ``1 <= N <= 2**31 - 32``, on CuPy's current device.
        causal: if True, query ``i`` attends to keys ``j <= i`` only.
        softmax_scale: factor applied to ``Q K^T`` before the softmax; default ``1 / sqrt(d)``.
        return_lse: also return the log-sum-exp of each row's scaled scores.

    Returns:
        ``out``, float32 ``[B, H, N, d]`` (new, contiguous); with ``return_lse`` the pair
        ``(out, lse)``, ``lse`` float32 ``[B, H, N]`` in natural log:
        ``lse[b, h, i] = log(sum_j exp(softmax_scale * q[b, h, i] . k[b, h, j]))`` over the keys
        ``i`` sees.

    Raises:
        TypeError: an input is not a float32 device array, or ``causal`` / ``softmax_scale`` has
            the wrong type.
        ValueError: wrong rank, shapes that differ, a zero or too large dimension, a non-finite
            ``softmax_scale``, or an input on another device.
    """
    q, k, v = _checked_inputs(q, k, v, max_head_dim=MAX_HEAD_DIM)
    batch, heads, seqlen, head_dim = q.shape
    if heads > MAX_GRID_YZ or batch > MAX_GRID_YZ or seqlen > MAX_SEQLEN:
        raise ValueError(f"q, k, v: flash_attn_minimal supports B <= {MAX_GRID_YZ}, H <= {MAX_GRID_YZ} "
                         f"and N <= {MAX_SEQLEN}; got shape {tuple(q.shape)}")
    causal = checks.require_bool(causal, "causal")
    scale = checks.checked_softmax_scale(softmax_scale, 1.0 / math.sqrt(head_dim), positive=False)
    q, k, v = _on_current_device(q, k, v)

    out = cupy.empty(q.shape, dtype=cupy.float32)
    lse = cupy.empty((batch, heads, seqlen), dtype=cupy.float32)
    params = FlashAttnMinimalParams(
        q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, out=out.data.ptr, lse=lse.data.ptr,
        heads=heads, seqlen=seqlen, head_dim=head_dim, causal=int(causal), softmax_scale=scale,
    )
    tile = head_dim_tile(head_dim)
    kernel = launch.get_kernel(PROGRAM, f"flashmla::flash_attn_minimal_kernel<{tile}>")
    grid = (-(-seqlen // BLOCK_M), heads, batch)
    kernel.launch(grid, (THREADS, 1, 1), bytes(params), smem=smem_bytes(head_dim), stream=None)
    return (out, lse) if return_lse else out


def manual_attention(q, k, v, causal=False, softmax_scale=None):
    """The tutorial's baseline in CuPy: ``softmax(softmax_scale * Q K^T) V``, float32 throughout.

    Materializes the ``[B, H, N, N]`` score matrix in global memory (what the flash kernel avoids);
    matmuls go through cuBLAS. Same inputs and checks as :func:`flash_attn_minimal`, except that
    any head dim ``d >= 1`` is accepted. Returns ``out``, float32 ``[B, H, N, d]``.
    """
    q, k, v = _checked_inputs(q, k, v, max_head_dim=None)
    causal = checks.require_bool(causal, "causal")
    scale = checks.checked_softmax_scale(softmax_scale, 1.0 / math.sqrt(q.shape[-1]), positive=False)
    q, k, v = _on_current_device(q, k, v)

    scores = cupy.matmul(q, k.swapaxes(-1, -2))
    scores *= np.float32(scale)
    if causal:
        seqlen = q.shape[2]
        scores = cupy.where(cupy.tri(seqlen, dtype=bool), scores, np.float32(-np.inf))
    scores -= scores.max(axis=-1, keepdims=True)     # exp() of at most 0: no overflow
    probs = cupy.exp(scores, out=scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return cupy.matmul(probs, v)


# --------------------------------------------------------------------------------------------
# Argument checks (the shared helpers of flashmla_cupy.checks): every message names the
# argument, what was expected and what was given. Shapes and dtypes are checked before anything
# touches the GPU.
# --------------------------------------------------------------------------------------------

def _checked_inputs(q, k, v, max_head_dim: int | None):
    arrays = [checks.device_view(x, name, "a float32 GPU array [B, H, N, d]")
              for x, name in ((q, "q"), (k, "k"), (v, "v"))]
    for x, name in zip(arrays, "qkv"):
        checks.require_dtype(x, name, [np.float32])
        checks.require_ndim(x, name, 4, "[B, H, N, d]")
    q, k, v = arrays
    for x, name in ((k, "k"), (v, "v")):
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape [B, H, N, d] = {tuple(q.shape)}; "
                             f"got {tuple(x.shape)}")
    for size, dim in zip(q.shape, ("B", "H", "N", "d")):
        if size == 0:
            raise ValueError(f"q, k, v: {dim} must be at least 1; got shape {tuple(q.shape)}")
    if max_head_dim is not None and q.shape[3] > max_head_dim:
        raise ValueError(f"q, k, v: head dim d must be at most {max_head_dim}; "
                         f"got d={q.shape[3]} (shape {tuple(q.shape)})")
    return q, k, v


def _on_current_device(q, k, v):
    """Check that the inputs live on CuPy's current device; make them contiguous there."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        checks.require_current_device(x, name)
    return tuple(cupy.ascontiguousarray(x) for x in (q, k, v))
