"""flashmla-cupy: FlashMLA decoding attention for Hopper GPUs on CuPy, without PyTorch.

Public API::

    get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k)
    flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                           tile_scheduler_metadata, num_splits, softmax_scale=None, causal=False,
                           *, out=None, lse=None, workspace=None)
    get_mla_workspace(q, k_cache, tile_scheduler_metadata)   scratch for allocation-free calls
    flash_attn_minimal(q, k, v, causal=False, softmax_scale=None, return_lse=False)
    reference            float64 NumPy/CuPy references (flashmla_cupy.reference)
    set_value_checks, value_checks   host-side value checks on/off (see flashmla_cupy.checks)
"""
from . import reference
from .attention import flash_attn_minimal
from .checks import UnsupportedDeviceError, set_value_checks, value_checks
from .mla import MLAWorkspace, flash_mla_with_kvcache, get_mla_metadata, get_mla_workspace

__version__ = "0.1.0"

__all__ = [
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "get_mla_workspace",
    "MLAWorkspace",
    "flash_attn_minimal",
    "reference",
    "set_value_checks",
    "value_checks",
    "UnsupportedDeviceError",
    "__version__",
]
