"""Python model of the tile scheduler (``cuda_src/mla/metadata_kernel.cu``, FlashMLA's
``get_mla_metadata``).

The split-KV kernel runs ``num_sm_parts`` persistent CTAs per (query block, KV head), about one
per SM. Before it, the scheduler divides the batch's work among those parts:

* Work is counted in KV pages of ``block_n`` (64) tokens. A request costs its pages plus
  ``fixed_overhead`` (5) pages' worth: every piece of a request that a part processes also loads
  Q, runs a prologue and writes O and lse, whatever its length. Without that term a part given
  many short requests would take far longer than one given a single long request.
* Every part gets the same budget, the *payload*: ``ceil(total_cost / num_sm_parts) +
  overhead``, where ``total_cost = sum(ceil(seqlen / block_n) + overhead)`` (FlashMLA 9241ae3's
  formula; its 2025-04 release also floored the payload at ``2 * overhead``, which at small
  batches gave a few parts five pages each while the rest idled).
* Walking the requests in order, a part takes each whole remaining request while it fits in its
  budget. The first one that does not fit is cut: the part takes as many of its pages as the
  budget allows after paying the overhead (if that is at least one page) and the next part
  continues from there.
* Each piece of a request processed by one part is a *split*. A request with one split is written
  straight to the output by the split-KV kernel; one with several has each split write a partial
  O and lse (normalized by its own softmax sum) that the combine kernel merges.

The extra overhead in the payload pays for the one additional split a part can create, so that
the walk always ends within ``num_sm_parts`` parts: a part either uses its whole budget (the last
piece cut to fit) or leaves at most ``overhead`` of it unused and creates no split; and since the
payload exceeds the overhead, a part that cuts a request takes at least one of its pages.

Outputs, exactly as the kernel writes them (int32):

* ``tile_scheduler_metadata[part] = [begin_req, begin_token, end_req, end_token, begin_split,
  topk, 0, 0]``: the part processes tokens ``[begin_token, ...)`` of request ``begin_req`` through
  tokens ``[..., end_token)`` of request ``end_req`` (whole requests in between), and its piece
  of ``begin_req`` is that request's split number ``begin_split``. A part with nothing left to do
  has ``begin_req == batch`` (and ``end_req == batch - 1``). ``topk`` is what the metadata was
  computed for: -1 for dense decoding, and for sparse decoding (``get_mla_metadata(...,
  topk=...)``, where every request is scheduled as ``topk`` tokens long) indices' last
  dimension; the split-KV kernel refuses metadata whose ``topk`` is not its call's
  (``ERROR_METADATA_KIND``).
* ``num_splits[i]`` = number of splits of the requests before i (``num_splits[0] = 0``): request
  i's splits are the global indices ``num_splits[i] .. num_splits[i + 1] - 1`` of the split
  workspace.

``parts_work`` expands the metadata back into (part, request, page range, split) pieces the way
the split-KV kernel reads it; the tests check invariants on it and a profiler can show balance.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .constants import BLOCK_M, FIXED_OVERHEAD_BLOCKS, BLOCK_N, SCHED_META_INTS  # noqa: F401 (re-exported)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def num_sm_parts(sm_count: int, num_heads_per_head_k: int, num_heads_k: int) -> int:
    """How many parts the batch is divided into (FlashMLA's formula, at least 1).

    The split-KV grid is (query blocks of 64 rows, KV heads, parts); the parts are sized so that
    the whole grid fills the GPU once: ``sm_count // num_heads_k // ceil(num_heads_per_head_k /
    64)``, where ``num_heads_per_head_k = s_q * h_q // h_kv`` query rows per KV head.
    """
    return max(sm_count // num_heads_k // _ceil_div(num_heads_per_head_k, BLOCK_M), 1)


def _validated_seqlens(seqlens) -> list[int]:
    array = np.asarray(seqlens)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"seqlens must be a non-empty 1-D sequence of ints; got {array!r}")
    if (array < 0).any():
        raise ValueError(f"seqlens must be >= 0; got {array.tolist()}")
    return [int(s) for s in array]


def payload(seqlens, num_sm_parts: int, block_n: int = BLOCK_N,
            fixed_overhead: int = FIXED_OVERHEAD_BLOCKS) -> int:
    """The budget of every part, in pages (see the module docstring)."""
    seqlens = _validated_seqlens(seqlens)
    total_cost = sum(_ceil_div(s, block_n) + fixed_overhead for s in seqlens)   # 64-bit in the kernel
    return _ceil_div(total_cost, num_sm_parts) + fixed_overhead


def schedule(seqlens, num_sm_parts: int, block_n: int = BLOCK_N,
             fixed_overhead: int = FIXED_OVERHEAD_BLOCKS, *, topk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The metadata kernel's output for one batch, computed on the host.

    Args:
        seqlens: ints ``[batch]`` (batch >= 1), tokens per request, on the host.
        num_sm_parts: parts to divide the batch into (``num_sm_parts(...)``), >= 1.
        block_n, fixed_overhead: page size in tokens and per-piece overhead in pages.
        topk: sparse decoding (``get_mla_metadata(..., topk=topk)``), >= 1: every request is
            scheduled as ``topk`` tokens long (only ``len(seqlens)`` counts, as in the kernel)
            and ``topk`` is recorded in slot 5; None (dense): slot 5 is -1.

    Returns:
        ``(tile_scheduler_metadata, num_splits)``: int32 ``[num_sm_parts, 8]`` and int32
        ``[batch + 1]``, bit-identical to what ``mla_metadata_kernel`` writes.
    """
    if topk is not None:
        if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or not 1 <= topk < 2**31:
            raise ValueError(f"topk must be an int in [1, 2**31); got {topk!r}")
        array = np.asarray(seqlens)
        if array.ndim != 1 or array.size == 0:
            raise ValueError(f"seqlens must be a non-empty 1-D sequence; got {array!r}")
        seqlens = [int(topk)] * array.size
    seqlens = _validated_seqlens(seqlens)
    if num_sm_parts < 1:
        raise ValueError(f"num_sm_parts must be >= 1; got {num_sm_parts}")
    batch = len(seqlens)
    budget_per_part = payload(seqlens, num_sm_parts, block_n, fixed_overhead)
    metadata = np.zeros((num_sm_parts, SCHED_META_INTS), dtype=np.int32)
    num_splits = np.zeros(batch + 1, dtype=np.int32)

    # The walk's position: request `req`, its first page not yet assigned, and how many splits
    # of it earlier parts have taken.
    req = page = split = 0
    for part in range(num_sm_parts):
        begin_req, begin_token, begin_split = req, page * block_n, split
        budget = budget_per_part
        while req < batch:
            pages_left = _ceil_div(seqlens[req], block_n) - page
            if budget >= pages_left + fixed_overhead:       # the rest of this request fits
                num_splits[req + 1] = num_splits[req] + split + 1
                budget -= pages_left + fixed_overhead
                req, page, split = req + 1, 0, 0
            else:                                            # cut it: take the pages that fit
                if budget > fixed_overhead:
                    page += budget - fixed_overhead
                    split += 1
                break
        if page > 0:     # the part ends inside request `req`, at a page boundary
            end_req, end_token = req, page * block_n
        else:            # the part ends with the whole of request req - 1
            end_req, end_token = req - 1, seqlens[req - 1]
        metadata[part, :6] = (begin_req, begin_token, end_req, end_token, begin_split, -1 if topk is None else topk)

    # FlashMLA asserts the same on the device: the payload leaves no work unassigned.
    if (req, page, split) != (batch, 0, 0):
        raise RuntimeError(f"scheduler walk ended at request {req} page {page} of {batch} requests")
    return metadata, num_splits


class WorkItem(NamedTuple):
    """Pages ``[first_page, end_page)`` of ``request``, processed by ``part`` as the request's
    split number ``split`` (0 for a request processed whole). A request of length 0 is one item
    with no pages: its part still writes its output (zeros, lse = +inf)."""
    part: int
    request: int
    first_page: int
    end_page: int
    split: int

    @property
    def pages(self) -> int:
        return self.end_page - self.first_page


def parts_work(metadata, seqlens, block_n: int = BLOCK_N) -> list[WorkItem]:
    """The pieces of work in ``metadata``, in part order, read as the split-KV kernel reads them.

    Args:
        metadata: ``[num_sm_parts, 8]`` ints, from ``schedule`` or copied from the GPU.
        seqlens: ints ``[batch]``, the lengths the metadata was computed for (with ``topk``:
            ``topk`` for every request).
    """
    seqlens = _validated_seqlens(seqlens)
    items = []
    for part, row in enumerate(np.asarray(metadata)):
        begin_req, begin_token, end_req, end_token, begin_split = (int(v) for v in row[:5])
        # An idle part has begin_req == batch > end_req: no iterations.
        for req in range(begin_req, end_req + 1):
            first_page = begin_token // block_n if req == begin_req else 0
            end_page = _ceil_div(end_token if req == end_req else seqlens[req], block_n)
            items.append(WorkItem(part, req, first_page, end_page, begin_split if req == begin_req else 0))
    return items


def part_costs(metadata, seqlens, block_n: int = BLOCK_N,
               fixed_overhead: int = FIXED_OVERHEAD_BLOCKS) -> np.ndarray:
    """Cost of each part's work in pages (pages + overhead per piece), int64 ``[num_sm_parts]``:
    the load balance the scheduler achieved (each is at most the payload)."""
    costs = np.zeros(len(metadata), dtype=np.int64)
    for item in parts_work(metadata, seqlens, block_n):
        costs[item.part] += item.pages + fixed_overhead
    return costs
