"""The call plan of ``flash_mla_with_kvcache``: everything that depends only on the arguments'
layout, prepared once and reused by every call with that layout.

A plan (``CallPlan`` for dense calls, ``sparse.SparsePlan`` for sparse ones, both built on
``LaunchPlan``) holds the checked sizes, the two prebuilt launches (split-KV, combine) with their
constant parameter fields, the TMA tensor maps (re-encoded only when an address changes), the
error record of its device and a default workspace. ``layout_key`` reads what a plan depends on
from CuPy arrays or torch tensors without converting them; a call whose key is known skips every
check and only writes the pointers of its arrays into the two parameter structs.
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import struct
import threading

import cupy
import numpy as np

from . import checks, errors, interop, launch, programs, tma
from .constants import (BLOCK_M, BLOCK_N, COMBINE_WARPS, FP8_NARROW_ROWS, FP8_STAGED_ROW_BYTES,
                        HEAD_DIM_K, HEAD_DIM_V, OUT_STORE_BYTES, PRODUCER_THREADS, SPLITKV_THREADS, TMA_BOX)
from .params import CombineParams, SplitKVParams

_ndarray = cupy.ndarray
_LSE_BYTES = np.dtype(np.float32).itemsize      # lse's alignment: the kernels store it a float at a time


def layout_key(arrays):
    """``(key, pointers)`` of a call's arrays, all CuPy arrays or all torch tensors (None for an
    absent optional one); None for other or mixed types.

    The key holds every array's shape, strides, dtype, device and 16-byte alignment: all that the
    checks look at besides values. It runs on every call: one loop, no helper calls.
    """
    key, pointers = [], []
    if type(arrays[0]) is _ndarray:
        for x in arrays:
            if type(x) is _ndarray:
                d = x.data
                p = d.ptr
                key += (x.shape, x.strides, x.dtype, d.device_id, p % 16)
                pointers.append(p)
            elif x is None:
                key.append(None)
                pointers.append(0)
            else:
                return None
        return tuple(key), pointers
    tensor = interop.torch_tensor_type()
    if tensor is None or type(arrays[0]) is not tensor:
        return None
    key.append("torch")
    for x in arrays:
        if type(x) is tensor:
            p = x.data_ptr()
            key += (x.shape, x.stride(), x.dtype, x.get_device(), p % 16)
            pointers.append(p)
        elif x is None:
            key.append(None)
            pointers.append(0)
        else:
            return None
    return tuple(key), pointers


def _contiguous_strides(shape, itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of ``shape``."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


class MLAWorkspace:
    """Scratch memory of ``flash_mla_with_kvcache`` for one batch shape: the split outputs that
    the combine kernel merges and, with several KV heads, O in the kernels' row layout (Q in that
    layout too, allocated on first need). One allocation from ``alloc(nbytes)`` (default: CuPy),
    which returns any CUDA array; the workspace keeps it alive. Not for concurrent streams."""

    def __init__(self, batch: int, s_q: int, h_q: int, h_kv: int, num_sm_parts: int, dtype, alloc=None):
        self.device_id = cupy.cuda.runtime.getDevice()
        self.dtype = np.dtype(dtype)
        self.signature = (self.device_id, batch, s_q, h_q, h_kv, num_sm_parts, self.dtype)
        self.batch, self.s_q, self.h_q, self.h_kv = batch, s_q, h_q, h_kv
        self.q_rows = s_q * (h_q // h_kv)
        self.total_splits = batch + num_sm_parts        # a request adds at most one split per part
        self._alloc = alloc or (lambda nbytes: cupy.empty((nbytes,), dtype=np.uint8))
        split_rows = self.total_splits * h_kv * self.q_rows
        sizes = {"lse_accum": split_rows * 4, "o_accum": split_rows * HEAD_DIM_V * 4,
                 "o_rows": batch * self.q_rows * h_kv * HEAD_DIM_V * self.dtype.itemsize if h_kv > 1 else 0}
        offsets, total = {}, 0
        for name, size in sizes.items():
            offsets[name] = total
            total += -(-size // 256) * 256
        self._memory = self._alloc(total)
        base = interop.data_pointer(self._memory)
        self.lse_accum_ptr = base + offsets["lse_accum"]
        self.o_accum_ptr = base + offsets["o_accum"]
        self.o_rows_ptr = base + offsets["o_rows"] if h_kv > 1 else 0
        self._q_rows_memory = None
        self._q_rows_ptr = 0

    def q_rows_ptr(self) -> int:
        """Q as ``[batch][q_rows][h_kv][576]``, for q layouts the kernel cannot read directly."""
        if not self._q_rows_ptr:
            self._q_rows_memory = self._alloc(self.batch * self.q_rows * self.h_kv * HEAD_DIM_K * self.dtype.itemsize)
            self._q_rows_ptr = interop.data_pointer(self._q_rows_memory)
        return self._q_rows_ptr

    def view(self, name: str, q_dtype=None) -> cupy.ndarray:
        """A CuPy view of a buffer: ``lse_accum``, ``o_accum``, ``o_rows`` or ``q_rows`` (in
        ``q_dtype`` if given: an e4m3 q's bytes)."""
        splits, rows = self.total_splits, self.q_rows
        if name == "lse_accum":
            shape, dtype, ptr = (splits, self.h_kv, rows), np.float32, self.lse_accum_ptr
        elif name == "o_accum":
            shape, dtype, ptr = (splits, self.h_kv, rows, HEAD_DIM_V), np.float32, self.o_accum_ptr
        elif name == "o_rows" and self.h_kv > 1:
            shape, dtype, ptr = (self.batch, rows, self.h_kv, HEAD_DIM_V), self.dtype, self.o_rows_ptr
        elif name == "q_rows":
            shape, dtype, ptr = (self.batch, rows, self.h_kv, HEAD_DIM_K), q_dtype or self.dtype, self.q_rows_ptr()
        else:
            raise ValueError(f"no workspace buffer {name!r}")
        return interop.device_view_of(ptr, shape, dtype, self, self.device_id)


# The pointer fields that change from call to call are consecutive in both parameter structs,
# so each call writes them with one struct.pack_into.
SPLITKV_POINTERS = ("block_table", "seqlens", "sched_meta", "num_splits", "lse", "lse_accum", "o_accum", "o", "error")
COMBINE_POINTERS = ("num_splits", "lse_accum", "o_accum", "o", "lse", "error")


def pointer_run(struct_type, names) -> tuple[int, str]:
    offsets = [getattr(struct_type, n).offset for n in names]
    assert offsets == list(range(offsets[0], offsets[0] + 8 * len(names), 8)), names
    return offsets[0], f"<{len(names)}Q"


@dataclasses.dataclass
class TensorMapField:
    """A TMA tensor map in the split-KV parameters (``tma.rows_4d_at``), encoded again only when
    its array's address changes."""
    offset: int                      # of the field in SplitKVParams
    shape: tuple                     # [outer][rows][heads][cols]
    strides: tuple                   # bytes
    box_rows: int
    box_bytes: int = 0               # 0: the plan's 16-bit dtype, boxes 64 columns wide; else e4m3
                                     # values, boxes this many bytes wide (128-byte swizzle in all)
    l2_promotion: int = 128          # bytes the L2 fetches per box row (docs/perf-notes.md section 49)
    address: int | None = None       # of the array last encoded


class LaunchPlan:
    """What the dense and the sparse call plans share: device, stream, error record, the
    outputs' layouts, the default workspace, the tensor maps, and the start of every run
    (outputs and workspace checked before anything is allocated or launched). A subclass
    defines ``_prepare_launches`` and ``run``."""

    workspace_call = "get_mla_workspace(q, k_cache, tile_scheduler_metadata)"

    def __init__(self, stream_ptr: int, family: str, dtype, out_shape, lse_shape, workspace_signature, maps,
                 q_dtype=None):
        self.dtype = dtype
        self.q_dtype = dtype if q_dtype is None else q_dtype
        self.family = family                  # "cupy" or "torch": the arrays of this layout
        self.device_id = cupy.cuda.runtime.getDevice()
        self.stream_ptr = stream_ptr
        self.record = errors.record(self.device_id)
        self.out_shape, self.lse_shape = out_shape, lse_shape
        self.out_strides = _contiguous_strides(out_shape, dtype.itemsize)
        self.lse_strides = _contiguous_strides(lse_shape, 4)
        self._torch_out = self._torch_lse = None   # torch outputs' layouts (torch's strides count elements)
        if family == "torch":
            self._torch_out = (out_shape, tuple(s // dtype.itemsize for s in self.out_strides),
                               interop.torch_dtype(dtype))
            self._torch_lse = (lse_shape, tuple(s // 4 for s in self.lse_strides),
                               interop.torch_dtype(np.dtype(np.float32)))
        self.workspace_signature = (self.device_id, *workspace_signature, dtype)
        self._own_workspace = None
        self._maps: list[TensorMapField] = maps
        self.splitkv = self.combine = None     # prepared on the first run, after the outputs' checks
        self._lock = threading.Lock()

    def _begin_run(self, out, lse, workspace):
        """``(out, out_ptr, lse, lse_ptr, workspace)`` of a run: the caller's outputs and workspace
        checked, the launches prepared, missing outputs allocated."""
        errors.raise_pending(self.record)
        if out is not None:
            out, out_ptr = self._output_pointer(out, "out", self.out_shape, self.out_strides, self.dtype,
                                                self._torch_out, OUT_STORE_BYTES)
        if lse is not None:
            lse, lse_ptr = self._output_pointer(lse, "lse", self.lse_shape, self.lse_strides, np.float32,
                                                self._torch_lse, _LSE_BYTES)
        ws = self._workspace(workspace)
        if self.splitkv is None:
            with self._lock:
                if self.splitkv is None:
                    self._prepare_launches()
        if out is None:
            out = self._new_output(self.out_shape, self.dtype)
            out_ptr = out.data.ptr
        if lse is None:
            lse = self._new_output(self.lse_shape, np.float32)
            lse_ptr = lse.data.ptr
        return out, out_ptr, lse, lse_ptr, ws

    def _workspace(self, workspace) -> MLAWorkspace:
        if workspace is None:
            if self._own_workspace is None:
                self._own_workspace = MLAWorkspace(*self.workspace_signature[1:])
            return self._own_workspace
        if type(workspace) is not MLAWorkspace or workspace.signature != self.workspace_signature:
            got = getattr(workspace, "signature", type(workspace).__name__)
            raise ValueError(f"workspace must come from {self.workspace_call} for this call's shapes "
                             f"(device, requests, s_q, h_q, h_kv, num_sm_parts, dtype = {self.workspace_signature}); "
                             f"got {got}")
        return workspace

    def _output_pointer(self, x, name: str, shape, strides, dtype, torch_layout, align: int) -> tuple[object, int]:
        """A caller-provided output (CuPy array, torch tensor or any CUDA array) and its address,
        after checking shape, layout, dtype, device and alignment (``align`` bytes)."""
        ptr = None
        if type(x) is _ndarray:
            d = x.data
            if x.shape == shape and x.strides == strides and x.dtype == dtype and d.device_id == self.device_id:
                ptr = d.ptr
        elif torch_layout is not None and type(x) is interop.torch_tensor_type():
            t_shape, t_strides, t_dtype = torch_layout
            if x.shape == t_shape and x.stride() == t_strides and x.dtype == t_dtype and x.get_device() == self.device_id:
                ptr = x.data_ptr()
        if ptr is None:
            ptr = checks.output_array(x, name, shape, dtype).data.ptr     # converts a foreign array, or raises
        if ptr % align:
            raise ValueError(f"{name} must start on a {align}-byte boundary (the kernels write it {align} bytes at "
                             f"a time); got address {ptr:#x}")
        return x, ptr

    def _new_output(self, shape, dtype):
        if self.stream_ptr == cupy.cuda.get_current_stream().ptr:
            return cupy.empty(shape, dtype=dtype)
        with interop.on_stream(self.stream_ptr):      # the pool ties memory to its stream
            return cupy.empty(shape, dtype=dtype)

    def _copy_q_rows(self, q_ptr: int, q, ws: MLAWorkspace) -> int:
        """Q into the workspace as [batch][s_q * heads_per_kv][h_kv][576], where the kernel cannot
        read it in place; returns its address."""
        a = self.inputs
        src = interop.device_view_of(q_ptr, (a.batch, a.s_q, a.h_q, HEAD_DIM_K), self.q_dtype, q, self.device_id,
                                     strides=a.q_strides)
        dst = ws.view("q_rows", self.q_dtype)
        with interop.on_stream(self.stream_ptr):
            dst.reshape(a.batch, a.s_q, a.heads_per_kv, a.h_kv, HEAD_DIM_K)[...] = \
                src.reshape(a.batch, a.s_q, a.h_kv, a.heads_per_kv, HEAD_DIM_K).transpose(0, 1, 3, 2, 4)
        return dst.data.ptr

    def _update_map(self, index: int, address: int) -> None:
        """Re-encode a tensor map only when its array's address changed."""
        m = self._maps[index]
        if m.address != address:
            dtype, box_cols = (np.uint8, m.box_bytes) if m.box_bytes else (self.dtype, TMA_BOX)
            raw = tma.rows_4d_at(address, dtype, m.shape, m.strides, box_rows=m.box_rows, box_cols=box_cols,
                                 l2_promotion=m.l2_promotion)
            ctypes.memmove(self.splitkv.params_address + m.offset, raw, len(raw))
            m.address = address


# The dense caches' pointer fields: the sparse kernel's (indices .. attn_sink unused), the cache's
# bytes (read by the FP8 kernels, and by the 16-bit one at one-token pages) and the FP8 scales.
DENSE_SPLITKV_POINTERS = SPLITKV_POINTERS + ("indices", "topk_length", "attn_sink", "cache", "kv_scale", "q_scale")


class CallPlan(LaunchPlan):
    """A checked dense call layout on one device and stream: kernels, launch configurations,
    constant parameter fields, tensor maps and a default workspace. The 16-bit cache is read by
    TMA (its tensor map here); so is the FP8 cache's bytes, which the kernel expands in place."""

    def __init__(self, a: checks.MLAInputs, stream_ptr: int, family: str):
        # Sizes only: a plan must not keep the caller's arrays (the cache can be many GB) alive.
        self.inputs = a = dataclasses.replace(a, q=None, k_cache=None, block_table=None, cache_seqlens=None,
                                              tile_scheduler_metadata=None, num_splits=None, k_scale=None)
        # Q is read in place when its (token, head) pairs form evenly strided rows; else it is
        # copied into the workspace as [batch][q_rows][h_kv][576].
        s_b, s_s, s_h, _ = a.q_strides
        self.q_in_place = a.h_kv == 1 and (a.s_q == 1 or s_s == a.h_q * s_h) and s_b % 16 == 0 and s_h % 16 == 0
        esize = a.q_dtype.itemsize
        if self.q_in_place:
            q_layout = ((a.batch, a.q_rows, 1, HEAD_DIM_K), (s_b, s_h, s_h * a.q_rows, esize))
        else:
            rows = (a.batch, a.q_rows, a.h_kv, HEAD_DIM_K)
            q_layout = (rows, _contiguous_strides(rows, esize))
        # e4m3 values (an e4m3 q, the FP8 cache) are staged as rows of 128 bytes (fp8_staged.cuh)
        q_map = TensorMapField(SplitKVParams.tma_q.offset, *q_layout, BLOCK_M, FP8_STAGED_ROW_BYTES if a.fp8_q else 0)
        # A box is one piece of a page (kernel). Where several m-blocks' CTAs read each page, 256-byte
        # L2 promotion takes 0.4-0.9 % off the compute-bound rows; with one m-block it costs the
        # memory-bound ones 0.5-1.2 % (docs/perf-notes.md section 49).
        kv_map = TensorMapField(SplitKVParams.tma_kv.offset, a.k_cache_shape, a.k_cache_strides,
                                min(a.k_cache_shape[1], BLOCK_N), FP8_STAGED_ROW_BYTES if a.fp8_cache else 0,
                                l2_promotion=256 if a.q_rows > BLOCK_M else 128)
        super().__init__(stream_ptr, family, a.dtype, (a.batch, a.s_q, a.h_q, HEAD_DIM_V), (a.batch, a.h_q, a.s_q),
                         (a.batch, a.s_q, a.h_q, a.h_kv, a.num_sm_parts), [q_map, kv_map], q_dtype=a.q_dtype)

    def _prepare_launches(self) -> None:
        """Load (compiling on first use) the kernels and prebuild both launches."""
        a = self.inputs
        tag = "fp16" if self.dtype == np.float16 else "bf16"
        combine = launch.get_kernel(programs.combine_program(tag))
        one_token_pages = a.k_cache_shape[1] == 1
        if a.fp8_cache and not a.fp8_q and a.q_rows <= FP8_NARROW_ROWS:
            # few rows of a bf16 q: MMAs on fragments dequantized in registers (fp8_narrow_kernel.cu)
            kernel, threads = programs.fp8_narrow_form(a.q_rows, one_token_pages)
            splitkv = launch.get_kernel(programs.fp8_narrow_program(), kernel)
            grid, smem = (1, a.h_kv, a.num_sm_parts), programs.FP8_NARROW_SMEM_BYTES
        else:
            splitkv_tag = (programs.FP8_Q_TAG if a.fp8_q else programs.FP8_TAG) if a.fp8_cache else tag
            splitkv = launch.get_kernel(programs.splitkv_program(splitkv_tag, one_token_pages))
            # a warpgroup more: the 16-bit cache's loader warps, the FP8 cache's expander (fp8_expand.cuh)
            threads = SPLITKV_THREADS + PRODUCER_THREADS
            grid, smem = (-(-a.q_rows // BLOCK_M), a.h_kv, a.num_sm_parts), programs.SPLITKV_SMEM_BYTES
        self.splitkv = splitkv.prepare(grid, (threads, 1, 1), SplitKVParams, smem=smem, stream=self.stream_ptr,
                                       pdl=True)
        p = self.splitkv.params
        p.block_table_stride, p.max_blocks_per_seq = a.block_table_stride, a.block_table_columns
        p.num_blocks, p.page_block_size = a.k_cache_shape[:2]
        p.page_shift = p.page_block_size.bit_length() - 1
        p.piece_shift = min(p.page_block_size, BLOCK_N).bit_length() - 1
        p.cache_block_stride, p.cache_head_stride = a.k_cache_strides[0], a.k_cache_strides[2]
        p.total_splits = a.batch + a.num_sm_parts
        p.batch, p.s_q, p.q_rows, p.heads_per_kv = a.batch, a.s_q, a.q_rows, a.heads_per_kv
        p.h_q, p.h_kv, p.causal, p.sparse_s_q = a.h_q, a.h_kv, int(a.causal), 1
        p.scale_log2 = a.softmax_scale * math.log2(math.e)

        rows_per_batch = a.h_kv * a.q_rows
        self.combine = combine.prepare(
            (a.batch, -(-rows_per_batch // COMBINE_WARPS), 1), (COMBINE_WARPS * 32, 1, 1), CombineParams,
            smem=COMBINE_WARPS * a.num_sm_parts * 4, stream=self.stream_ptr, pdl=True)
        c = self.combine.params
        c.batch, c.q_rows, c.h_kv, c.heads_per_kv = a.batch, a.q_rows, a.h_kv, a.heads_per_kv
        c.s_q, c.h_q, c.max_splits, c.total_splits = a.s_q, a.h_q, a.num_sm_parts, a.batch + a.num_sm_parts
        c.sparse_s_q = 1
        self._splitkv_pointers = pointer_run(SplitKVParams, DENSE_SPLITKV_POINTERS)
        self._combine_pointers = pointer_run(CombineParams, COMBINE_POINTERS)

    def run(self, pointers, q, out, lse, workspace):
        """Launch both kernels for arrays of this plan's layout at ``pointers`` (q, k_cache,
        block_table, cache_seqlens, metadata, num_splits[, k_scale, q_scale or 0]); ``q`` is only read
        for a copy."""
        a = self.inputs
        out, out_ptr, lse, lse_ptr, ws = self._begin_run(out, lse, workspace)
        q_ptr, k_ptr, table_ptr, seqlens_ptr, meta_ptr, splits_ptr = pointers[:6]
        error_ptr = errors.kernel_pointer(self.record)
        with self._lock:
            if not self.q_in_place:
                q_ptr = self._copy_q_rows(q_ptr, q, ws)
            o_ptr = out_ptr if a.h_kv == 1 else ws.o_rows_ptr
            self._update_map(0, q_ptr)
            lse_accum_ptr, o_accum_ptr = ws.lse_accum_ptr, ws.o_accum_ptr
            offset, fmt = self._splitkv_pointers
            self._update_map(1, k_ptr)
            scales = pointers[6:8] if a.fp8_cache else (0, 0)
            struct.pack_into(fmt, self.splitkv.buffer, offset, table_ptr, seqlens_ptr, meta_ptr, splits_ptr,
                             lse_ptr, lse_accum_ptr, o_accum_ptr, o_ptr, error_ptr, 0, 0, 0, k_ptr, *scales)
            self.splitkv()
            offset, fmt = self._combine_pointers
            struct.pack_into(fmt, self.combine.buffer, offset, splits_ptr, lse_accum_ptr, o_accum_ptr, o_ptr,
                             lse_ptr, error_ptr)
            self.combine()
            if a.h_kv > 1:
                self._copy_o_rows(ws, out_ptr, out)
        errors.after_launch(self.record, self.stream_ptr)
        return out, lse

    # --- layouts the kernels cannot use in place (several KV heads, unevenly strided q) -------

    def _copy_o_rows(self, ws: MLAWorkspace, out_ptr: int, out) -> None:
        a = self.inputs
        dst = interop.device_view_of(out_ptr, self.out_shape, self.dtype, out, self.device_id)
        src = ws.view("o_rows")
        with interop.on_stream(self.stream_ptr):
            dst.reshape(a.batch, a.s_q, a.h_kv, a.heads_per_kv, HEAD_DIM_V)[...] = \
                src.reshape(a.batch, a.s_q, a.heads_per_kv, a.h_kv, HEAD_DIM_V).transpose(0, 1, 3, 2, 4)
