"""FlashMLA's own times from another run, shown beside ours where the GPU is of the same kind.

FlashMLA's sparse FP8 decoding kernel needs nvcc and torch to build; where it is built
(``tools/flashmla_upstream``), ``profile sparse --baseline flash_mla`` times it in the same run.
Without it, on an H200 the table gets FlashMLA's times from one earlier run on an H200 instead, as
a ``flash_mla`` row per shape (with the speed-up), noted as not measured here.
"""
from __future__ import annotations

TARGET = "flash_mla"          # the name of FlashMLA's own call, as --baseline flash_mla names it
GPU = "H200"                  # the anchors are shown where the device's name contains this

# From "FlashMLA's sparse FP8 decoding on the lent H200 (measured 2026-11-22)"
# (shared/notes/anchors-sparse-fp8-h200.md): FlashMLA 9241ae3, its own harness.
SPARSE_FP8_H200_US = {
    # (batch, h_q, s_q, s_k, topk): µs
    (2, 128, 2, 32768, 2048): 20.3,
    (64, 128, 2, 32768, 2048): 186.9,
    (74, 128, 2, 32768, 2048): 226.3,
    (128, 128, 2, 32768, 2048): 364.6,
    (128, 64, 2, 32768, 2048): 226.4,
    (128, 128, 1, 32768, 2048): 187.0,
    (148, 64, 2, 32768, 16384): 1866.7,
    (148, 128, 2, 32768, 16384): 3050.6,
}

NOTE = ("anchors from another run, not measured in this one: FlashMLA 9241ae3 on an H200, 2026-11-22, timed by "
        "its own test harness (split-KV + combine kernel time from a profiler trace, cache lengths drawn around "
        "s_k)")


def flash_mla_sparse_ms(shape, gpu_name: str) -> float | None:
    """FlashMLA's time in ms for a ``shapes.SparseShape``, where ``gpu_name`` is an H200 and the
    anchor run has that shape; else ``None``."""
    us = SPARSE_FP8_H200_US.get(shape.key) if GPU in gpu_name else None
    return None if us is None else us / 1e3
