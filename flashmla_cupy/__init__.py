"""flashmla-cupy: FlashMLA decoding attention for Hopper GPUs on CuPy, without PyTorch.

Public API::

    get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, *, out=None, stream=None)
    flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
                           tile_scheduler_metadata, num_splits, softmax_scale=None, causal=False,
                           *, out=None, lse=None, workspace=None, stream=None)
    get_mla_workspace(q, k_cache, tile_scheduler_metadata, *, alloc=None)   scratch for allocation-free calls
    metadata_shapes(batch, num_heads_per_head_k, num_heads_k)              get_mla_metadata's output shapes
    set_value_checks, value_checks, value_check_mode, check_errors         bad values: "async" / "sync" / "off"
    flash_attn_minimal(q, k, v, causal=False, softmax_scale=None, return_lse=False)
    reference            float64 NumPy/CuPy references (flashmla_cupy.reference)
    flashmla_cupy.flash_mla   FlashMLA's functions on torch tensors (imports torch when used)
"""
from .versions import check_environment as _check_environment

_check_environment()       # one line naming what to install, before CuPy fails somewhere deeper

from . import reference
from .attention import flash_attn_minimal
from .checks import UnsupportedDeviceError
from .errors import check_errors, set_value_checks, value_check_mode, value_checks
from .mla import MLAWorkspace, flash_mla_with_kvcache, get_mla_metadata, get_mla_workspace, metadata_shapes

__version__ = "0.1.0"

__all__ = [
    "get_mla_metadata",
    "flash_mla_with_kvcache",
    "get_mla_workspace",
    "metadata_shapes",
    "MLAWorkspace",
    "flash_attn_minimal",
    "reference",
    "set_value_checks",
    "value_checks",
    "value_check_mode",
    "check_errors",
    "UnsupportedDeviceError",
    "__version__",
]
