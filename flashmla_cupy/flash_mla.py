"""FlashMLA's Python functions on torch tensors: a drop-in for ``flash_mla`` on Hopper.

    from flashmla_cupy.flash_mla import get_mla_metadata, flash_mla_with_kvcache

Same signatures and results as FlashMLA's (2025-04) module: torch tensors in and out, on the
tensors' device and torch's current stream. torch is imported when a function runs, not when this
module is imported, so the rest of flashmla_cupy never needs it.

Per call: outputs from torch's caching allocator (as FlashMLA does), the arrays' pointers read
in place (no DLPack conversion), and one workspace per (device, stream, batch shape) allocated
through torch. Everything a call allocates comes from torch, so calls can be captured inside
``torch.cuda.graph`` (allocations then come from the graph's pool), with inputs and metadata in
static buffers updated in place before each replay.
"""
from __future__ import annotations

import functools

import cupy

from . import mla
from .constants import HEAD_DIM_V

__all__ = ["get_mla_metadata", "flash_mla_with_kvcache"]


@functools.lru_cache(maxsize=None)
def _torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError("flashmla_cupy.flash_mla works on torch tensors and needs PyTorch (pip install torch); "
                          "the rest of flashmla_cupy works on CuPy arrays without it") from e
    return torch


def _current_stream(torch, device_index: int) -> int:
    """torch's current stream on the device, as a raw handle (torch's internal getter when it has
    one: a tenth of the cost of ``torch.cuda.current_stream``)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device_index) if raw is not None else torch.cuda.current_stream(device_index).cuda_stream


class _OnDevice:
    """CuPy's current device set to ``index`` for the duration of a call (a no-op when it is)."""

    __slots__ = ("index", "previous")

    def __init__(self, index: int):
        self.index = index
        self.previous = None

    def __enter__(self):
        current = cupy.cuda.runtime.getDevice()
        if current != self.index:
            self.previous = current
            cupy.cuda.runtime.setDevice(self.index)

    def __exit__(self, *exc):
        if self.previous is not None:
            cupy.cuda.runtime.setDevice(self.previous)
        return False


def get_mla_metadata(cache_seqlens, num_heads_per_head_k: int, num_heads_k: int):
    """Tile-scheduler metadata of one batch (FlashMLA's ``get_mla_metadata``).

    Args:
        cache_seqlens: torch.int32 ``[batch]`` on a CUDA device.
        num_heads_per_head_k: ``s_q * h_q // h_kv``.
        num_heads_k: ``h_kv``.

    Returns:
        ``(tile_scheduler_metadata, num_splits)``: torch.int32 ``[num_sm_parts, 8]`` and
        ``[batch + 1]`` on cache_seqlens' device.
    """
    torch = _torch()
    if not isinstance(cache_seqlens, torch.Tensor) or not cache_seqlens.is_cuda:
        raise TypeError(f"cache_seqlens must be a CUDA torch.Tensor; got {type(cache_seqlens).__name__}"
                        + ("" if not isinstance(cache_seqlens, torch.Tensor) else f" on {cache_seqlens.device}"))
    device = cache_seqlens.device
    with _OnDevice(device.index):
        meta_shape, splits_shape = mla.metadata_shapes(cache_seqlens.shape[0], num_heads_per_head_k, num_heads_k)
        metadata = torch.empty(meta_shape, dtype=torch.int32, device=device)
        num_splits = torch.empty(splits_shape, dtype=torch.int32, device=device)
        return mla.get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, out=(metadata, num_splits),
                                    stream=_current_stream(torch, device.index))


_workspaces: dict[tuple, mla.MLAWorkspace] = {}
_MAX_WORKSPACES = 16


def _workspace(torch, q, k_cache, metadata, device, stream: int) -> mla.MLAWorkspace:
    """One torch-allocated workspace per device, stream and batch shape (kept alive here); None
    for arguments that the call will reject with a clear message."""
    try:
        key = (device.index, stream, q.shape, k_cache.shape[2], metadata.shape[0], q.dtype)
        ws = _workspaces.get(key)
        if ws is None:
            ws = mla.get_mla_workspace(
                q, k_cache, metadata, alloc=lambda nbytes: torch.empty((nbytes,), dtype=torch.uint8, device=device))
            if len(_workspaces) >= _MAX_WORKSPACES:
                _workspaces.clear()
            _workspaces[key] = ws
    except Exception:  # noqa: BLE001 - wrong types or shapes: flash_mla_with_kvcache says which
        return None
    return ws


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v: int, tile_scheduler_metadata,
                           num_splits, softmax_scale: float | None = None, causal: bool = False):
    """Paged MLA decoding attention (FlashMLA's ``flash_mla_with_kvcache``) on torch tensors.

    Args:
        q: ``[batch, s_q, h_q, 576]``, torch.bfloat16 or torch.float16.
        k_cache: ``[num_blocks, 64, h_kv, 576]``, q's dtype.
        block_table: torch.int32 ``[batch, max_blocks_per_seq]``.
        cache_seqlens: torch.int32 ``[batch]``.
        head_dim_v: 512.
        tile_scheduler_metadata, num_splits: from ``get_mla_metadata``.
        softmax_scale: default ``576 ** -0.5``.
        causal: causal mask over the s_q query tokens (MTP).

    Returns:
        ``(out, lse)``: ``[batch, s_q, h_q, 512]`` in q's dtype and torch.float32
        ``[batch, h_q, s_q]``. Argument errors raise as in ``flashmla_cupy.flash_mla_with_kvcache``;
        bad values in cache_seqlens / block_table give NaN rows and a ``ValueError`` from a later
        call (see the README's "Value checks").
    """
    torch = _torch()
    if not isinstance(q, torch.Tensor) or not q.is_cuda or q.dim() != 4:
        raise TypeError(f"q must be a 4-D CUDA torch.Tensor [batch, s_q, h_q, 576]; got "
                        + (f"shape {tuple(q.shape)} on {q.device}" if isinstance(q, torch.Tensor) else type(q).__name__))
    device = q.device
    stream = _current_stream(torch, device.index)
    batch, s_q, h_q, _ = q.shape
    with _OnDevice(device.index):
        out = torch.empty((batch, s_q, h_q, HEAD_DIM_V), dtype=q.dtype, device=device)
        lse = torch.empty((batch, h_q, s_q), dtype=torch.float32, device=device)
        workspace = _workspace(torch, q, k_cache, tile_scheduler_metadata, device, stream)
        return mla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                          num_splits, softmax_scale, causal, out=out, lse=lse, workspace=workspace,
                                          stream=stream)
