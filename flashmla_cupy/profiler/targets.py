"""What the profiler times: a *target* is a name and ``setup(inputs) -> Prepared``.

``setup`` does everything that belongs outside the timed region (scheduler metadata, plans, one
validating call whose result feeds ``--check``) and returns ``Prepared.run``, the zero-argument
callable that is timed. A new implementation plugs in by adding a ``Target`` to ``MLA_TARGETS`` or
``ATTENTION_TARGETS``; ``requires`` says (one line) why it cannot run here, or ``None``.

MLA targets take ``inputs.MLABenchInputs`` and return ``(out [b, s_q, h_q, 512], lse [b, h_q, s_q])``;
attention targets take ``inputs.AttentionInputs`` and return ``out [B, H, N, d]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Prepared:
    run: Callable[[], Any]          # the timed call
    result: Any = None              # one call's output, made in setup (all checks on)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    setup: Callable[[Any], Prepared]
    requires: Callable[[], str | None] = lambda: None


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return f"{type(e).__name__}: {s.splitlines()[0]}" if s else type(e).__name__


# --------------------------------------------------------------------------------------------
# MLA decoding
# --------------------------------------------------------------------------------------------

def _requires_flashmla() -> str | None:
    try:
        from .. import mla  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"flashmla_cupy.mla unavailable ({_first_line(e)})"
    return None


def _no_value_checks():
    """The public API's host-side value checks synchronize; keep them out of the timed calls."""
    from ..checks import value_checks
    return value_checks(False)


def setup_flashmla(inp) -> Prepared:
    from .. import mla

    s = inp.shape
    meta, splits = mla.get_mla_metadata(inp.cache_seqlens, s.s_q * s.h_q // s.h_kv, s.h_kv)
    args = (inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, s.dv, meta, splits)
    first = mla.flash_mla_with_kvcache(*args, causal=s.causal)

    def run():
        with _no_value_checks():
            return mla.flash_mla_with_kvcache(*args, causal=s.causal)

    return Prepared(run, first)


def _requires_cublas() -> str | None:
    from .ceilings import cublas_status
    return cublas_status()


def setup_cupy_baseline(inp) -> Prepared:
    from .. import baselines

    s = inp.shape
    plan = baselines.PagedMLA(inp.block_table, inp.cache_seqlens, s_q=s.s_q, h_q=s.h_q, h_kv=s.h_kv,
                              page_block=inp.k_cache.shape[1], d=s.d, head_dim_v=s.dv, causal=s.causal)

    def run():
        return plan(inp.q, inp.k_cache)

    notes = [f"{len(plan.chunks)} chunks of requests"] if len(plan.chunks) > 1 else []
    return Prepared(run, run(), notes)


MLA_TARGETS: dict[str, Target] = {
    "flashmla": Target("flashmla", "flash_mla_with_kvcache: split-KV + combine kernels (PDL); "
                                   "metadata computed once beforehand", setup_flashmla, _requires_flashmla),
    "cupy": Target("cupy", "plain CuPy paged MLA (gather pages, float32 cuBLAS matmuls, softmax): "
                           "the seed benchmark's torch target", setup_cupy_baseline, _requires_cublas),
}
MAIN_MLA_TARGET = "flashmla"


# --------------------------------------------------------------------------------------------
# Attention (seed 000)
# --------------------------------------------------------------------------------------------

def _requires_attention(name: str) -> Callable[[], str | None]:
    def check() -> str | None:
        try:
            from .. import attention
        except Exception as e:  # noqa: BLE001
            return f"flashmla_cupy.attention unavailable ({_first_line(e)})"
        if not hasattr(attention, name):
            return f"flashmla_cupy.attention has no {name}"
        return None
    return check


def setup_flash_attn_minimal(inp) -> Prepared:
    from .. import attention

    c = inp.shape.causal

    def run():
        return attention.flash_attn_minimal(inp.q, inp.k, inp.v, causal=c)

    return Prepared(run, run())


def setup_manual_attention(inp) -> Prepared:
    from .. import attention

    c = inp.shape.causal

    def run():
        return attention.manual_attention(inp.q, inp.k, inp.v, causal=c)

    return Prepared(run, run())


ATTENTION_TARGETS: dict[str, Target] = {
    "flash_attn_minimal": Target("flash_attn_minimal", "the minimal FlashAttention kernel (seed 000), float32",
                                 setup_flash_attn_minimal, _requires_attention("flash_attn_minimal")),
    "manual": Target("manual", "manual attention: softmax(Q Kᵀ / √d) V through CuPy/cuBLAS, float32",
                     setup_manual_attention, _requires_attention("manual_attention")),
}
MAIN_ATTENTION_TARGET = "flash_attn_minimal"
ATTENTION_BASELINE = "manual"
