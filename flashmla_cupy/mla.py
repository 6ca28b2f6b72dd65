"""MLA decoding on CuPy arrays: the public functions, read top to bottom.

``get_mla_metadata`` runs the tile scheduler on the GPU; ``flash_mla_with_kvcache`` checks its
arguments, builds the TMA tensor maps and parameter structs, and launches the split-KV kernel
and then the combine kernel, both with Programmatic Dependent Launch, on CuPy's current stream.
The kernels are compiled by NVRTC on first use (cached on disk, see ``compiler``).
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import struct
import threading
from collections import OrderedDict

import cupy
import numpy as np

from . import checks, launch, scheduler, tma
from .compiler import Program
from .params import CombineParams, MetadataParams, SplitKVParams, layout_defines

SPLITKV_THREADS = 256
COMBINE_WARPS = 8
_CTYPES = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t"}


def dtype_tag(dtype) -> str:
    return "fp16" if np.dtype(dtype) == np.float16 else "bf16"


def _splitkv_smem_bytes() -> int:
    """The split-KV kernel's SharedStorage (splitkv_traits.cuh; the compile checks they agree):
    Q and two pages of 64 x 576 16-bit values, P0 (64 x 64), five 64-float row vectors,
    19 mbarriers, padded to 1024 bytes."""
    tile = 64 * 64 * 2
    size = 3 * 9 * tile + tile + 5 * 64 * 4 + 19 * 8
    return -(-size // 1024) * 1024


SPLITKV_SMEM_BYTES = _splitkv_smem_bytes()


def splitkv_program(tag: str) -> Program:
    return Program(f"splitkv_mla<{tag}>", "mla/splitkv_kernel.cu",
                   (f"flashmla::splitkv_mla_kernel<{_CTYPES[tag]}>",),
                   layout_defines() + (("FLASHMLA_SPLITKV_SMEM_BYTES", str(SPLITKV_SMEM_BYTES)),))


def combine_program(tag: str) -> Program:
    return Program(f"mla_combine<{tag}>", "mla/combine_kernel.cu",
                   (f"flashmla::mla_combine_kernel<{_CTYPES[tag]}>",), layout_defines())


def metadata_program() -> Program:
    return Program("mla_metadata", "mla/metadata_kernel.cu", ("flashmla::mla_metadata_kernel",),
                   layout_defines())


def all_programs() -> list[Program]:
    """Every MLA kernel program (for ahead-of-time builds: ``flashmla-cupy compile``)."""
    return [splitkv_program("bf16"), splitkv_program("fp16"), combine_program("bf16"),
            combine_program("fp16"), metadata_program()]


def _kernel(program: Program) -> launch.Kernel:
    return launch.get_kernel(program, program.kernels[0])


def get_mla_metadata(cache_seqlens, num_heads_per_head_k: int, num_heads_k: int):
    """Tile-scheduler metadata for one batch of decoding requests.

    Args:
        cache_seqlens: int32 ``[batch]`` on the GPU, tokens in each request's KV cache.
        num_heads_per_head_k: query rows per KV head, ``s_q * h_q // h_kv``.
        num_heads_k: KV heads ``h_kv`` (1 for DeepSeek's MLA).

    Returns:
        ``(tile_scheduler_metadata, num_splits)``: int32 ``[num_sm_parts, 8]`` — per SM part,
        the (request, token) range it processes — and int32 ``[batch + 1]``, prefix sums of each
        request's number of splits. Compute it once per batch and pass it to every
        ``flash_mla_with_kvcache`` call (every layer) of that batch.
    """
    seqlens, heads_per_kv, h_kv, props = checks.metadata_inputs(cache_seqlens, num_heads_per_head_k, num_heads_k)
    parts = scheduler.num_sm_parts(props["sm_count"], heads_per_kv, h_kv)
    batch = seqlens.shape[0]
    metadata = cupy.empty((parts, scheduler.SCHED_META_INTS), dtype=np.int32)
    num_splits = cupy.empty((batch + 1,), dtype=np.int32)
    params = MetadataParams(seqlens=seqlens.data.ptr, sched_meta=metadata.data.ptr,
                            num_splits=num_splits.data.ptr, batch=batch,
                            block_n=scheduler.PAGE_BLOCK_SIZE,
                            fixed_overhead_blocks=scheduler.FIXED_OVERHEAD_BLOCKS, num_sm_parts=parts)
    _kernel(metadata_program()).launch((1, 1, 1), (32, 1, 1), params)
    return metadata, num_splits


def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v: int,
                           tile_scheduler_metadata, num_splits, softmax_scale: float | None = None,
                           causal: bool = False, *, out=None, lse=None, workspace=None):
    """Paged MLA decoding attention (FlashMLA's interface) on CuPy arrays.

    Args:
        q: ``[batch, s_q, h_q, 576]``, ``ml_dtypes.bfloat16`` or ``float16``; s_q > 1 for MTP /
            speculative decoding.
        k_cache: ``[num_blocks, 64, h_kv, 576]``, q's dtype; pages of 64 tokens. V is its first
            512 columns (K and V share the latent).
        block_table: int32 ``[batch, max_blocks_per_seq]``, page ids of each request in order.
        cache_seqlens: int32 ``[batch]``, tokens per request (0 allowed).
        head_dim_v: 512.
        tile_scheduler_metadata, num_splits: from ``get_mla_metadata(cache_seqlens,
            s_q * h_q // h_kv, h_kv)`` of this batch.
        softmax_scale: default ``576 ** -0.5``.
        causal: with s_q > 1, query token i sees the first ``seqlen - (s_q - 1 - i)`` tokens.
        out, lse: optional preallocated outputs (C-contiguous, shapes and dtypes as returned);
            given, the results are written there and the same arrays are returned.
        workspace: optional ``get_mla_workspace(...)`` for this batch shape. With ``out``,
            ``lse`` and a contiguous ``q``, the call then allocates nothing: it can be captured
            in a CUDA graph (keep the arrays alive as long as the graph).

    Returns:
        ``(out, lse)``: ``[batch, s_q, h_q, 512]`` in q's dtype and float32 ``[batch, h_q, s_q]``
        (natural-log sum of exp of the scaled scores). A row that sees no token gets out = 0 and
        lse = +inf. Tokens at or past a request's length are never read into the result (their
        cache slots may hold anything, NaN included).

    q's head h attends with kv head ``h // (h_q // h_kv)``. Arrays exposing ``__dlpack__`` or
    ``__cuda_array_interface__`` are used zero-copy. Host work per call is kept small: the
    arguments' layout is checked once per shape (``_Plan``), tensor maps are re-encoded only when
    an address changes, and each kernel is one prebuilt driver launch.
    """
    key = _plan_key(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                    head_dim_v, softmax_scale, causal)
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        a = checks.mla_inputs(q, k_cache, block_table, cache_seqlens, head_dim_v,
                              tile_scheduler_metadata, num_splits, softmax_scale, causal)
        q, k_cache, block_table, cache_seqlens = a.q, a.k_cache, a.block_table, a.cache_seqlens
        tile_scheduler_metadata, num_splits = a.tile_scheduler_metadata, a.num_splits
        plan = _Plan(a)
        if key is not None:
            _plans[key] = plan
            if len(_plans) > _MAX_PLANS:
                _plans.popitem(last=False)
    elif checks.value_checks_enabled():
        checks.check_values(cache_seqlens, block_table, k_cache.shape[0])
    return plan.run(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                    out, lse, workspace)


class MLAWorkspace:
    """Scratch memory of ``flash_mla_with_kvcache`` for one batch shape: the split outputs that
    the combine kernel merges and, with several KV heads, Q and O in the kernels' row layout."""

    def __init__(self, batch: int, s_q: int, h_q: int, h_kv: int, num_sm_parts: int, dtype):
        q_rows = s_q * (h_q // h_kv)
        total_splits = batch + num_sm_parts        # a request adds at most one split per part
        self.signature = (cupy.cuda.runtime.getDevice(), batch, s_q, h_q, h_kv, num_sm_parts, np.dtype(dtype))
        self.lse_accum = cupy.empty((total_splits, h_kv, q_rows), dtype=np.float32)
        self.o_accum = cupy.empty((total_splits, h_kv, q_rows, checks.HEAD_DIM_V), dtype=np.float32)
        self.q_rows = self.o_rows = None
        if h_kv > 1:
            self.q_rows = cupy.empty((batch, q_rows, h_kv, checks.HEAD_DIM_K), dtype=dtype)
            self.o_rows = cupy.empty((batch, q_rows, h_kv, checks.HEAD_DIM_V), dtype=dtype)


def get_mla_workspace(q, k_cache, tile_scheduler_metadata) -> MLAWorkspace:
    """A workspace for ``flash_mla_with_kvcache`` calls with these arrays' shapes and dtype."""
    q = checks.as_device_array(q, "q")
    k_cache = checks.as_device_array(k_cache, "k_cache")
    meta = checks.as_device_array(tile_scheduler_metadata, "tile_scheduler_metadata")
    checks.require_ndim(q, "q", 4, "[batch, s_q, h_q, 576]")
    checks.require_ndim(k_cache, "k_cache", 4, "[num_blocks, 64, h_kv, 576]")
    checks.require_ndim(meta, "tile_scheduler_metadata", 2, "[num_sm_parts, 8]")
    batch, s_q, h_q, _ = q.shape
    h_kv = k_cache.shape[2]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"k_cache's heads (axis 2) must divide q's heads ({h_q}); got {h_kv}")
    return MLAWorkspace(batch, s_q, h_q, h_kv, meta.shape[0], q.dtype)


_MAX_PLANS = 16
_plans: OrderedDict[tuple, "_Plan"] = OrderedDict()


def _plan_key(q, k_cache, block_table, cache_seqlens, metadata, num_splits, head_dim_v,
              softmax_scale, causal):
    """Everything the argument checks depend on except array contents and addresses (and the
    cache's alignment), as one flat tuple (this runs on every call: no nested tuples or helper
    calls); None (no plan reuse) unless all arrays are CuPy arrays and the scalars plain Python
    ones."""
    nd = cupy.ndarray
    if not (type(q) is nd and type(k_cache) is nd and type(block_table) is nd and type(cache_seqlens) is nd
            and type(metadata) is nd and type(num_splits) is nd and type(causal) is bool
            and type(head_dim_v) is int and (softmax_scale is None or type(softmax_scale) is float)):
        return None
    k_data = k_cache.data
    return (cupy.cuda.runtime.getDevice(), cupy.cuda.get_current_stream().ptr, head_dim_v, softmax_scale,
            causal, k_data.ptr % 16,
            q.shape, q.strides, q.dtype, q.data.device_id,
            k_cache.shape, k_cache.strides, k_cache.dtype, k_data.device_id,
            block_table.shape, block_table.strides, block_table.dtype, block_table.data.device_id,
            cache_seqlens.shape, cache_seqlens.strides, cache_seqlens.dtype, cache_seqlens.data.device_id,
            metadata.shape, metadata.strides, metadata.dtype, metadata.data.device_id,
            num_splits.shape, num_splits.strides, num_splits.dtype, num_splits.data.device_id)


# The pointer fields that change from call to call are consecutive in both parameter structs,
# so each call writes them with one struct.pack_into.
_SPLITKV_POINTERS = ("block_table", "seqlens", "sched_meta", "num_splits", "lse", "lse_accum", "o_accum", "o")
_COMBINE_POINTERS = ("num_splits", "lse_accum", "o_accum", "o", "lse")


def _pointer_run(struct_type, names) -> tuple[int, str]:
    offsets = [getattr(struct_type, n).offset for n in names]
    assert offsets == list(range(offsets[0], offsets[0] + 8 * len(names), 8)), names
    return offsets[0], f"<{len(names)}Q"


class _Plan:
    """A checked call layout: kernels, launch configurations, the constant parameter fields and
    a workspace, for calls with one shape on one device and stream."""

    def __init__(self, a: checks.MLAInputs):
        # Sizes only: a plan must not keep the caller's arrays (the cache can be many GB) alive.
        self.inputs = a = dataclasses.replace(a, q=None, k_cache=None, block_table=None, cache_seqlens=None,
                                              tile_scheduler_metadata=None, num_splits=None)
        self.dtype = a.dtype
        self.device_id = cupy.cuda.runtime.getDevice()
        self.out_shape = (a.batch, a.s_q, a.h_q, checks.HEAD_DIM_V)
        self.lse_shape = (a.batch, a.h_q, a.s_q)
        self.out_strides = tuple(self.dtype.itemsize * x for x in _contiguous_strides(self.out_shape))
        self.lse_strides = tuple(4 * x for x in _contiguous_strides(self.lse_shape))
        self.workspace_signature = (self.device_id, a.batch, a.s_q, a.h_q, a.h_kv, a.num_sm_parts,
                                    np.dtype(self.dtype))
        self._own_workspace = None
        # Q and the cache as the kernel's TMA sees them: [outer][rows][h_kv][cols], boxes 64 x 64.
        esize = self.dtype.itemsize
        rows_q = (a.batch, a.q_rows, a.h_kv, checks.HEAD_DIM_K)
        self._maps = [  # (field offset, shape, byte strides, last encoded address)
            [SplitKVParams.tma_q.offset, rows_q, tuple(esize * x for x in _contiguous_strides(rows_q)), None],
            [SplitKVParams.tma_kv.offset, a.k_cache_shape, a.k_cache_strides, None],
        ]
        self.q_is_rows = a.h_kv == 1 and a.q_contiguous
        self.splitkv = self.combine = None     # prepared on the first run, after the outputs' checks
        self._lock = threading.Lock()

    def _prepare_launches(self) -> None:
        """Load (compiling on first use) the kernels and prebuild both launches."""
        a = self.inputs
        tag = dtype_tag(self.dtype)
        num_m_blocks = -(-a.q_rows // scheduler.BLOCK_M)
        self.splitkv = _kernel(splitkv_program(tag)).prepare(
            (num_m_blocks, a.h_kv, a.num_sm_parts), (SPLITKV_THREADS, 1, 1), SplitKVParams,
            smem=SPLITKV_SMEM_BYTES, pdl=True)
        p = self.splitkv.params
        p.block_table_stride = a.block_table_stride
        p.batch, p.s_q, p.q_rows, p.heads_per_kv = a.batch, a.s_q, a.q_rows, a.heads_per_kv
        p.h_q, p.h_kv, p.causal = a.h_q, a.h_kv, int(a.causal)
        p.scale_log2 = a.softmax_scale * math.log2(math.e)

        rows_per_batch = a.h_kv * a.q_rows
        self.combine = _kernel(combine_program(tag)).prepare(
            (a.batch, -(-rows_per_batch // COMBINE_WARPS), 1), (COMBINE_WARPS * 32, 1, 1), CombineParams,
            smem=COMBINE_WARPS * a.num_sm_parts * 4, pdl=True)
        c = self.combine.params
        c.batch, c.q_rows, c.h_kv, c.heads_per_kv = a.batch, a.q_rows, a.h_kv, a.heads_per_kv
        c.s_q, c.h_q, c.max_splits = a.s_q, a.h_q, a.num_sm_parts
        self._splitkv_pointers = _pointer_run(SplitKVParams, _SPLITKV_POINTERS)
        self._combine_pointers = _pointer_run(CombineParams, _COMBINE_POINTERS)

    def _default_workspace(self) -> MLAWorkspace:
        if self._own_workspace is None:
            self._own_workspace = MLAWorkspace(*self.workspace_signature[1:])
        return self._own_workspace

    def _check_workspace(self, workspace) -> None:
        if type(workspace) is not MLAWorkspace or workspace.signature != self.workspace_signature:
            got = getattr(workspace, "signature", type(workspace).__name__)
            raise ValueError(f"workspace must come from get_mla_workspace for this call's shapes "
                             f"(device, batch, s_q, h_q, h_kv, num_sm_parts, dtype = "
                             f"{self.workspace_signature}); got {got}")

    def _output(self, x, name: str, shape, strides, dtype):
        if type(x) is cupy.ndarray and x.shape == shape and x.strides == strides and x.dtype == dtype \
                and x.data.device_id == self.device_id:
            return x
        return checks.output_array(x, name, shape, dtype)   # converts a foreign array, or raises

    def _update_map(self, index: int, address: int) -> None:
        """Re-encode a tensor map only when its array's address changed."""
        entry = self._maps[index]
        if entry[3] != address:
            raw = tma.rows_4d_at(address, self.dtype, entry[1], entry[2])
            ctypes.memmove(self.splitkv.params_address + entry[0], raw, len(raw))
            entry[3] = address

    def run(self, q, k_cache, block_table, cache_seqlens, metadata, num_splits, out, lse, workspace):
        a = self.inputs
        # Caller-provided outputs and workspace are checked before anything is allocated.
        if out is not None:
            out = self._output(out, "out", self.out_shape, self.out_strides, self.dtype)
        if lse is not None:
            lse = self._output(lse, "lse", self.lse_shape, self.lse_strides, np.float32)
        if workspace is not None:
            self._check_workspace(workspace)
        if self.splitkv is None:
            with self._lock:
                if self.splitkv is None:
                    self._prepare_launches()
        if out is None:
            out = cupy.empty(self.out_shape, dtype=self.dtype)
        if lse is None:
            lse = cupy.empty(self.lse_shape, dtype=np.float32)
        ws = self._default_workspace() if workspace is None else workspace
        with self._lock:
            # Query rows per kv head are (token, head-in-group) pairs: [b, q_rows, h_kv, 576].
            # With one kv head (and q contiguous) that is q itself, and O's rows are out itself.
            if a.h_kv == 1:
                q_ptr = (q if self.q_is_rows else cupy.ascontiguousarray(q)).data.ptr
                o_ptr = out.data.ptr
            else:
                ws.q_rows.reshape(a.batch, a.s_q, a.heads_per_kv, a.h_kv, checks.HEAD_DIM_K)[...] = \
                    q.reshape(a.batch, a.s_q, a.h_kv, a.heads_per_kv, checks.HEAD_DIM_K).transpose(0, 1, 3, 2, 4)
                q_ptr, o_ptr = ws.q_rows.data.ptr, ws.o_rows.data.ptr
            self._update_map(0, q_ptr)
            self._update_map(1, k_cache.data.ptr)
            num_splits_ptr, lse_ptr = num_splits.data.ptr, lse.data.ptr
            lse_accum_ptr, o_accum_ptr = ws.lse_accum.data.ptr, ws.o_accum.data.ptr
            offset, fmt = self._splitkv_pointers
            struct.pack_into(fmt, self.splitkv.buffer, offset, block_table.data.ptr, cache_seqlens.data.ptr,
                             metadata.data.ptr, num_splits_ptr, lse_ptr, lse_accum_ptr, o_accum_ptr, o_ptr)
            self.splitkv()
            offset, fmt = self._combine_pointers
            struct.pack_into(fmt, self.combine.buffer, offset, num_splits_ptr, lse_accum_ptr, o_accum_ptr,
                             o_ptr, lse_ptr)
            self.combine()
        if a.h_kv > 1:
            out.reshape(a.batch, a.s_q, a.h_kv, a.heads_per_kv, checks.HEAD_DIM_V)[...] = \
                ws.o_rows.reshape(a.batch, a.s_q, a.heads_per_kv, a.h_kv, checks.HEAD_DIM_V).transpose(0, 1, 3, 2, 4)
        return out, lse


def _contiguous_strides(shape) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
