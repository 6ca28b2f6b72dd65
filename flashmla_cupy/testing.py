"""Random MLA decoding inputs that catch kernels reading what they must not (tests, fuzzing, tools).

Every input is fresh random data (never zeros). The KV cache holds the requests' pages at
randomly permuted block ids among spare blocks; every slot no request may read (spare blocks,
tokens past a request's length) is NaN, and block-table columns past a request's pages hold
garbage ids, so a kernel that reads anything it should not produces NaN or a fault.
"""
from __future__ import annotations

from dataclasses import dataclass

import cupy
import ml_dtypes
import numpy as np

PAGE = 64
D_K = 576
D_V = 512

DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16)}


@dataclass
class MLAInputs:
    q: cupy.ndarray
    k_cache: cupy.ndarray
    block_table: cupy.ndarray
    cache_seqlens: cupy.ndarray
    seqlens: np.ndarray            # host copy
    s_q: int
    h_q: int
    h_kv: int

    def describe(self) -> str:
        b = len(self.seqlens)
        return (f"b={b} s_q={self.s_q} h_q={self.h_q} h_kv={self.h_kv} dtype={self.q.dtype} "
                f"seqlens[:8]={self.seqlens[:8].tolist()}")


def seed_seqlens(rng: np.random.Generator, batch: int, mean: int, s_q: int, varlen: bool) -> np.ndarray:
    """FlashMLA's test draw: mean for all, or normal(mean, mean/2) clipped to at least s_q."""
    if not varlen:
        return np.full(batch, mean, dtype=np.int32)
    return np.maximum(rng.normal(mean, mean / 2, batch), s_q).astype(np.int32)


def make_inputs(rng: np.random.Generator, seqlens, s_q: int, h_q: int, h_kv: int, dtype: str,
                spare_blocks: int = 3, garbage_columns: int = 2) -> MLAInputs:
    seqlens = np.asarray(seqlens, dtype=np.int32)
    batch = len(seqlens)
    pages = -(-seqlens // PAGE)
    used = int(pages.sum())
    num_blocks = used + spare_blocks
    ids = rng.permutation(num_blocks).astype(np.int32)
    width = int(pages.max(initial=0)) + garbage_columns
    table = rng.integers(num_blocks, 2**31 - 1, size=(batch, max(width, 1)), dtype=np.int32)
    table[:, ::2] = -1 - table[:, ::2] % 1000                # garbage: negative or huge ids
    valid_tokens = np.zeros(num_blocks, dtype=np.int32)     # per block id: readable tokens
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = ids[start:start + n]
        valid_tokens[ids[start:start + n]] = np.clip(seqlens[i] - PAGE * np.arange(n), 0, PAGE)
        start += n

    q = _random(rng, (batch, s_q, h_q, D_K), dtype)
    k_cache = cupy.empty((num_blocks, PAGE, h_kv, D_K), dtype=DTYPES[dtype])
    valid = cupy.asarray(valid_tokens)
    chunk = max(1, (1 << 27) // (PAGE * h_kv * D_K))         # ~0.5 GB of float32 at a time
    gen = cupy.random.default_rng(int(rng.integers(2**63)))
    for lo in range(0, num_blocks, chunk):
        hi = min(num_blocks, lo + chunk)
        block = gen.standard_normal((hi - lo, PAGE, h_kv, D_K), dtype=np.float32)
        unreadable = cupy.arange(PAGE)[None, :] >= valid[lo:hi, None]
        block[unreadable] = np.nan
        k_cache[lo:hi] = block.astype(DTYPES[dtype])
    return MLAInputs(q, k_cache, cupy.asarray(table), cupy.asarray(seqlens), seqlens, s_q, h_q, h_kv)


def _random(rng: np.random.Generator, shape, dtype: str) -> cupy.ndarray:
    gen = cupy.random.default_rng(int(rng.integers(2**63)))
    return gen.standard_normal(shape, dtype=np.float32).astype(DTYPES[dtype])


def poisoned(shape, dtype) -> cupy.ndarray:
    """An output buffer full of NaN: any element the kernel fails to write stays NaN."""
    return cupy.full(shape, np.nan, dtype=np.float32).astype(dtype)
