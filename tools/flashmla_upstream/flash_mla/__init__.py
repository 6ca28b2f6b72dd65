"""FlashMLA upstream's decoding (its own kernels, built by ../build.sh) behind its Python API
(9241ae3: ``get_mla_metadata()`` then ``flash_mla_with_kvcache(..., sched_meta, None, ...)``), so
that ``flashmla-cupy profile --baseline flash_mla`` (and ``profile sparse --baseline flash_mla``)
times it beside flashmla-cupy. As upstream's binding: the scheduler runs in the first call, outputs
and split buffers come from torch on every call, lse is returned as [b, h_q, s_q]. Dense: bf16/fp16,
pages of 64; sparse (``indices=``): DeepSeek-V3.2's FP8 cache, h_q 64 or 128, optional attention
sink. Comparison only: h_kv = 1, contiguous tensors."""
import ctypes
import dataclasses
import os
from typing import Optional

import torch

__version__ = "9241ae3 decoding via tools/flashmla_upstream"
_LIB = os.environ.get("FLASHMLA_UP_LIB") or os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                                         "libflashmla_up.so")     # timeline.py: the stamped build
_lib = ctypes.CDLL(_LIB)
_ptr = ctypes.c_void_p
_lib.up_sched.argtypes = [ctypes.c_int] * 4 + [_ptr] * 4
_lib.up_decode.argtypes = [ctypes.c_int] * 7 + [ctypes.c_float] + [_ptr] * 5 + [ctypes.c_int] + [_ptr] * 6
_lib.up_sparse_decode.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float] + [_ptr] * 5 + [ctypes.c_int] + [_ptr] * 6
_META_INTS = _lib.up_sched_meta_bytes() // 4


@dataclasses.dataclass
class FlashMLASchedMeta:
    have_initialized: bool = False
    num_sm_parts: int = 0
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None


def get_mla_metadata(*args, **kwargs):
    return FlashMLASchedMeta(), None


def _schedule(meta, b, s_q, h_q, topk, seqlens, device, stream):
    """Upstream's scheduler, in the first call of a FlashMLASchedMeta: SMs / (64-row blocks of a
    request) parts; topk -1: dense, by `seqlens` (a device pointer)."""
    if meta.have_initialized:
        return
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    meta.num_sm_parts = max(sms // -(-s_q * h_q // 64), 1)
    meta.tile_scheduler_metadata = torch.empty(meta.num_sm_parts, _META_INTS, dtype=torch.int32, device=device)
    meta.num_splits = torch.empty(b + 1, dtype=torch.int32, device=device)
    err = _lib.up_sched(b, s_q, meta.num_sm_parts, topk, seqlens, meta.tile_scheduler_metadata.data_ptr(),
                        meta.num_splits.data_ptr(), stream)
    if err:
        raise RuntimeError(f"FlashMLA scheduler launch failed (cudaError {err})")
    meta.have_initialized = True


def _sparse(q, k_cache, indices, attn_sink, meta, scale):
    b, s_q, h_q, d = q.shape
    topk = indices.shape[-1]
    if d != 576 or h_q not in (64, 128) or tuple(k_cache.shape[2:]) != (1, 656):
        raise ValueError("this stand-in's sparse call: d = 576, h_q 64 or 128, k_cache [blocks, page, 1, 656]")
    if not (q.is_contiguous() and k_cache.is_contiguous() and indices.is_contiguous()):
        raise ValueError("this stand-in needs contiguous q, k_cache and indices")
    device = q.device
    stream = torch.cuda.current_stream(device).cuda_stream
    _schedule(meta, b, s_q, h_q, topk, None, device, stream)
    splits = b + meta.num_sm_parts
    out = torch.empty(b, s_q, h_q, 512, dtype=q.dtype, device=device)
    lse = torch.empty(b, s_q, h_q, dtype=torch.float32, device=device)
    lse_accum = torch.empty(splits, s_q, h_q, dtype=torch.float32, device=device)
    o_accum = torch.empty(splits, s_q, h_q, 512, dtype=torch.float32, device=device)
    err = _lib.up_sparse_decode(b, s_q, h_q, k_cache.shape[0], k_cache.shape[1], topk, scale, q.data_ptr(),
                                k_cache.data_ptr(), indices.data_ptr(),
                                None if attn_sink is None else attn_sink.data_ptr(),
                                meta.tile_scheduler_metadata.data_ptr(), meta.num_sm_parts,
                                meta.num_splits.data_ptr(), out.data_ptr(), lse.data_ptr(), lse_accum.data_ptr(),
                                o_accum.data_ptr(), stream)
    if err:
        raise RuntimeError(f"FlashMLA sparse decoding launch failed (cudaError {err})")
    return out, lse.transpose(1, 2)


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                           attn_sink=None, **kwargs):
    b, s_q, h_q, d = q.shape
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    if indices is not None:
        if not is_fp8_kvcache or causal or head_dim_v != 512:
            raise ValueError("sparse decoding: is_fp8_kvcache=True, causal=False, head_dim_v 512")
        return _sparse(q, k_cache, indices, attn_sink, tile_scheduler_metadata, scale)
    if d != 576 or head_dim_v != 512 or tuple(k_cache.shape[1:]) != (64, 1, 576):
        raise ValueError("this stand-in supports d = 576, head_dim_v = 512, pages of 64 tokens, h_kv = 1")
    if not (q.is_contiguous() and k_cache.is_contiguous() and block_table.is_contiguous()):
        raise ValueError("this stand-in needs contiguous q, k_cache and block_table")
    device = q.device
    stream = torch.cuda.current_stream(device).cuda_stream
    meta = tile_scheduler_metadata
    _schedule(meta, b, s_q, h_q, -1, cache_seqlens.data_ptr(), device, stream)
    rows, splits = s_q * h_q, b + meta.num_sm_parts
    out = torch.empty(b, rows, 512, dtype=q.dtype, device=device)
    lse = torch.empty(b, rows, dtype=torch.float32, device=device)
    lse_accum = torch.empty(splits, rows, dtype=torch.float32, device=device)
    o_accum = torch.empty(splits, rows, 512, dtype=torch.float32, device=device)
    err = _lib.up_decode(int(q.dtype == torch.float16), b, s_q, h_q, k_cache.shape[0], block_table.shape[1],
                         int(bool(causal)), scale, q.data_ptr(), k_cache.data_ptr(), block_table.data_ptr(),
                         cache_seqlens.data_ptr(), meta.tile_scheduler_metadata.data_ptr(), meta.num_sm_parts,
                         meta.num_splits.data_ptr(), out.data_ptr(), lse.data_ptr(), lse_accum.data_ptr(),
                         o_accum.data_ptr(), stream)
    if err:
        raise RuntimeError(f"FlashMLA decoding launch failed (cudaError {err})")
    return out.view(b, s_q, h_q, 512), lse.view(b, 1, s_q, h_q).transpose(2, 3).reshape(b, h_q, s_q)
