"""FlashMLA's Python functions on torch tensors: a drop-in for ``flash_mla`` on Hopper.

    from flashmla_cupy.flash_mla import get_mla_metadata, flash_mla_with_kvcache

The signatures and results of FlashMLA's module (2025-04): torch tensors in and out, on the
tensors' device and torch's current stream of that device. torch is imported the first time a
function runs, never by importing this module, so the rest of flashmla_cupy stays torch-free.

What a call does on the host: it allocates ``out`` and ``lse`` with torch (its caching
allocator, as FlashMLA does), reads the arrays' pointers in place (no DLPack conversion),
launches on torch's current stream (``stream=``), and takes the kernels' scratch memory from a
workspace allocated through torch:

* outside stream capture, one workspace per (device, stream, batch shape, dtype) kept in a small
  table and reused by every layer of every step;
* while the stream is capturing a CUDA graph, a fresh workspace for the call from torch's
  allocator (that is, from the graph's memory pool), released when the call returns, exactly
  like FlashMLA's own scratch tensors. A graph therefore never refers to memory that this module
  might free and torch hand to someone else later, and graphs that share a pool (vLLM, SGLang)
  share the workspace memory too.

So ``flash_mla_with_kvcache`` can be captured inside ``torch.cuda.graph`` the way inference
engines capture decoding: inputs and metadata in static buffers, updated in place before each
``graph.replay()``.

For code that mixes CuPy and torch (the profiler's torch targets): ``from_cupy``, ``cupy_stream``,
``cupy_device`` and ``torch_unavailable`` at the end of the module.
"""
from __future__ import annotations

import cupy

from . import driver, mla
from .constants import HEAD_DIM_V

__all__ = ["get_mla_metadata", "flash_mla_with_kvcache",
           "torch_unavailable", "from_cupy", "cupy_device", "cupy_stream"]

_get_device = cupy.cuda.runtime.getDevice
_set_device = cupy.cuda.runtime.setDevice

_torch = None              # the torch module, once imported
_raw_stream = None         # device index -> torch's current stream on it, as a raw handle


def _import_torch():
    global _torch, _raw_stream
    try:
        import torch
    except ImportError as e:
        raise ImportError("flashmla_cupy.flash_mla works on torch tensors and needs PyTorch (pip install torch); "
                          "the rest of flashmla_cupy works on CuPy arrays without it") from e
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # a tenth of current_stream's cost
    if getter is None:
        current_stream = torch.cuda.current_stream

        def getter(device_index: int) -> int:
            return current_stream(device_index).cuda_stream
    _raw_stream = getter
    _torch = torch
    return torch


def _cuda_index(torch, x, name: str) -> int:
    """The CUDA device index of torch tensor ``x``; ``TypeError`` for anything else."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a CUDA torch.Tensor; got {type(x).__module__}.{type(x).__qualname__}")
    index = x.get_device()
    if index < 0:
        raise TypeError(f"{name} must be a CUDA torch.Tensor; got one on {x.device}")
    return index


def _is_capturing(stream: int) -> bool:
    """Whether ``stream`` is capturing a CUDA graph; True also when the query fails (e.g. on the
    legacy stream while another stream captures): a per-call workspace is always safe."""
    try:
        return driver.is_capturing(stream)
    except driver.DriverError:
        return True


# --- get_mla_metadata ----------------------------------------------------------------------------

def get_mla_metadata(cache_seqlens, num_heads_per_head_k: int, num_heads_k: int, num_heads_q=None,
                     is_fp8_kvcache: bool = False, topk=None):
    """Tile-scheduler metadata of one decoding batch (FlashMLA's ``get_mla_metadata``).

    Args:
        cache_seqlens: torch.int32 ``[batch]`` on a CUDA device: tokens in each request's cache.
        num_heads_per_head_k: query rows per KV head, ``s_q * h_q // h_kv``.
        num_heads_k: KV heads ``h_kv``.
        num_heads_q, is_fp8_kvcache, topk: sparse decoding (DeepSeek-V3.2): ``topk`` =
            indices' last dim, ``num_heads_q`` = h_q (see ``flashmla_cupy.get_mla_metadata``).

    Returns:
        ``(tile_scheduler_metadata, num_splits)``, torch.int32 ``[num_sm_parts, 8]`` and
        ``[batch + 1]`` on cache_seqlens' device, written on torch's current stream. Compute them
        once per batch and pass them to every layer's ``flash_mla_with_kvcache``. The shapes
        depend only on the batch size and the heads, so they can be copied into static buffers
        (``meta.copy_(...)``) before a CUDA graph replays.
    """
    torch = _torch or _import_torch()
    index = _cuda_index(torch, cache_seqlens, "cache_seqlens")
    stream = _raw_stream(index)
    previous = _get_device()
    sparse = (num_heads_q, is_fp8_kvcache, topk)
    if previous == index:
        return _metadata(torch, cache_seqlens, num_heads_per_head_k, num_heads_k, sparse, stream)
    _set_device(index)
    try:
        return _metadata(torch, cache_seqlens, num_heads_per_head_k, num_heads_k, sparse, stream)
    finally:
        _set_device(previous)


def _metadata(torch, cache_seqlens, num_heads_per_head_k, num_heads_k, sparse: tuple, stream: int):
    num_heads_q, is_fp8_kvcache, topk = sparse
    try:
        if cache_seqlens.dim() != 1:
            raise ValueError(f"cache_seqlens must be 1-D [batch]; got {cache_seqlens.dim()}-D shape "
                             f"{tuple(cache_seqlens.shape)}")
        meta_shape, splits_shape = mla.metadata_shapes(cache_seqlens.shape[0], num_heads_per_head_k, num_heads_k,
                                                       num_heads_q, topk)
        metadata = cache_seqlens.new_empty(meta_shape, dtype=torch.int32)
        num_splits = cache_seqlens.new_empty(splits_shape, dtype=torch.int32)
    except (TypeError, ValueError, ArithmeticError, RuntimeError):
        # Bad arguments: the library's own checks name the argument and the rule.
        mla.get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, *sparse, stream=stream)
        raise
    return mla.get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, *sparse,
                                out=(metadata, num_splits), stream=stream)


# --- flash_mla_with_kvcache ----------------------------------------------------------------------

_workspaces: dict[tuple, mla.MLAWorkspace] = {}
_MAX_WORKSPACES = 16


def _workspace(torch, q, k_cache, tile_scheduler_metadata, sparse: bool, index: int,
               stream: int) -> mla.MLAWorkspace:
    """The call's workspace (see the module's docstring): a kept one outside stream capture, a
    fresh one from torch's allocator (the graph's pool) during capture."""
    if _is_capturing(stream):
        return _new_workspace(torch, q, k_cache, tile_scheduler_metadata, sparse)
    try:
        key = (index, stream, q.shape, q.dtype, k_cache.shape[2], tile_scheduler_metadata.shape[0], sparse)
    except (AttributeError, IndexError, TypeError):          # get_mla_workspace says what is wrong
        return _new_workspace(torch, q, k_cache, tile_scheduler_metadata, sparse)
    ws = _workspaces.get(key)
    if ws is None:
        ws = _new_workspace(torch, q, k_cache, tile_scheduler_metadata, sparse)
        if len(_workspaces) >= _MAX_WORKSPACES:
            _workspaces.clear()        # eager workspaces only: torch frees them in stream order
        _workspaces[key] = ws
    return ws


def _new_workspace(torch, q, k_cache, tile_scheduler_metadata, sparse: bool) -> mla.MLAWorkspace:
    device = q.device              # not q itself: a kept workspace would keep q alive

    def alloc(nbytes: int):
        return torch.empty((nbytes,), dtype=torch.uint8, device=device)

    return mla.get_mla_workspace(q, k_cache, tile_scheduler_metadata, sparse=sparse, alloc=alloc)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v: int, tile_scheduler_metadata,
                           num_splits, softmax_scale: float | None = None, causal: bool = False,
                           is_fp8_kvcache: bool = False, indices=None, attn_sink=None, topk_length=None, *,
                           k_scale=None, q_scale=None):
    """Paged MLA decoding attention on torch tensors (FlashMLA's ``flash_mla_with_kvcache``).

    Args:
        q: ``[batch, s_q, h_q, 576]``, torch.bfloat16 or torch.float16 (s_q > 1: MTP).
        k_cache: ``[num_blocks, page_block_size, h_kv, 576]`` in q's dtype: pages of any
            power-of-two size (FlashMLA: 64 only); V is the first 512 columns of each row.
        block_table: torch.int32 ``[batch, max_blocks_per_seq]``, each request's pages in order.
        cache_seqlens: torch.int32 ``[batch]``.
        head_dim_v: 512.
        tile_scheduler_metadata, num_splits: ``get_mla_metadata(cache_seqlens, s_q * h_q // h_kv,
            h_kv)`` of this batch.
        softmax_scale: scale of q·k before the softmax; default ``576 ** -0.5``.
        causal: with s_q > 1, query token i sees the first ``seqlen - (s_q - 1 - i)`` tokens.
        is_fp8_kvcache, indices, attn_sink, topk_length: sparse decoding over DeepSeek-V3.2's FP8
            cache (torch.uint8/int8/float8_e4m3fn ``[num_blocks, page_block_size, 1, 656]``,
            torch.int32 indices ``[batch, s_q, topk]``; block_table and cache_seqlens unused), as
            ``flashmla_cupy.flash_mla_with_kvcache`` documents them.
        k_scale: with ``is_fp8_kvcache=True`` and no indices, the dense FP8 cache (torch.uint8 or
            int8 ``[num_blocks, page_block_size, 1, 576]`` of e4m3 codes, q bf16): its
            torch.float32 one-element scale on the GPU (vLLM's ``k_scale``).
        q_scale: with k_scale, q may hold e4m3 values (torch.float8_e4m3fn, uint8 or int8):
            its torch.float32 one-element scale on the GPU; out is then torch.bfloat16. Both
            products then run in FP8, the softmax weights rounded to e4m3 for P V.

    Returns:
        ``(out, softmax_lse)``: ``[batch, s_q, h_q, 512]`` in q's dtype (bf16 for an e4m3 q) and torch.float32
        ``[batch, h_q, s_q]`` (natural log), new tensors on q's device, computed on torch's
        current stream. Argument errors raise as ``flashmla_cupy.flash_mla_with_kvcache``'s do;
        a bad value in cache_seqlens or block_table gives NaN rows for its request and a
        ``ValueError`` from a later call (the README's "Value checks").
    """
    torch = _torch or _import_torch()
    index = _cuda_index(torch, q, "q")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [batch, s_q, h_q, 576]; got {q.dim()}-D shape {tuple(q.shape)}")
    stream = _raw_stream(index)
    batch, s_q, h_q, _ = q.shape
    out = q.new_empty((batch, s_q, h_q, HEAD_DIM_V), dtype=torch.bfloat16 if q.element_size() == 1 else q.dtype)
    lse = q.new_empty((batch, h_q, s_q), dtype=torch.float32)
    previous = _get_device()
    if previous != index:
        _set_device(index)
    try:
        workspace = _workspace(torch, q, k_cache, tile_scheduler_metadata, indices is not None, index, stream)
        return mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                          num_splits, softmax_scale, causal, is_fp8_kvcache, indices, attn_sink,
                                          topk_length, k_scale=k_scale, q_scale=q_scale, out=out, lse=lse,
                                          workspace=workspace,
                                          stream=stream)
    finally:
        if previous != index:
            _set_device(previous)


# --- CuPy arrays and streams in torch --------------------------------------------------------------
# For code that mixes the two (the profiler's torch targets among them): torch is imported here,
# so that this stays the one module of the package that uses it.

def torch_unavailable() -> str | None:
    """Why the functions above cannot run here (one line: torch not importable, or without CUDA), or None."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        text = str(e).strip()
        return f"torch is not importable ({type(e).__name__}" + (f": {text.splitlines()[0]})" if text else ")")
    if not torch.cuda.is_available():
        return f"torch {getattr(torch, '__version__', '?')} has no CUDA device (a CPU-only build?)"
    return None


def from_cupy(array):
    """A torch tensor viewing ``array``'s memory (DLPack, no copy)."""
    return (_torch or _import_torch()).from_dlpack(array)


def cupy_device(array):
    """Context manager: CuPy array ``array``'s device is torch's current device inside."""
    return (_torch or _import_torch()).cuda.device(array.device.id)


def cupy_stream(stream):
    """Context manager: torch's current stream is CuPy stream ``stream`` (of CuPy's current device)
    inside, so that torch calls, CuPy's work and CUDA events on ``stream`` are ordered in one queue."""
    torch = _torch or _import_torch()
    return torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=_get_device()))
