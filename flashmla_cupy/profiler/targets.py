"""What the profiler times: a *target* is a name and ``setup(inputs) -> Prepared``.

``setup`` does everything that belongs outside the timed region (scheduler metadata, plans, one
validating call whose result feeds ``--check``) and returns ``Prepared.run``, the zero-argument
callable that is timed. A new implementation plugs in by adding a ``Target`` to ``MLA_TARGETS``,
``SPARSE_TARGETS`` or ``ATTENTION_TARGETS``; ``requires`` says (one line) why it cannot run here, or
``None``; ``supports(shape)`` says why it cannot run one shape (FlashMLA: pages other than 64
tokens, the FP8 cache and an e4m3 q), or ``None``: that row is skipped as not applicable, not failed.

MLA targets take ``inputs.MLABenchInputs`` (sparse ones ``inputs.SparseBenchInputs``) and return
``(out [b, s_q, h_q, 512], lse [b, h_q, s_q])``; attention targets take ``inputs.AttentionInputs``
and return ``out [B, H, N, d]``.

The MLA targets: ``flashmla`` (the default call on CuPy arrays), ``flashmla_torch`` (the torch
drop-in ``flashmla_cupy.flash_mla`` on torch tensors, ``--inputs torch``), ``flash_mla`` (FlashMLA's
own module, ``--baseline flash_mla``) and ``cupy`` (the plain CuPy baseline). The torch targets view
the same CuPy buffers through DLPack and are timed on the profiler's stream (``Prepared.on_stream``).
The sparse targets: ``flashmla`` again, the call with ``indices`` over the FP8 cache, and
``flash_mla`` (FlashMLA's own sparse call, upstream API only: the seed has none; ``--baseline
flash_mla``).
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import flash_mla as torch_drop_in   # importing it does not import torch
from .shapes import FP8_CACHE, PAGE_BLOCK


@dataclass
class Prepared:
    run: Callable[[], Any]          # the timed call
    result: Any = None              # one call's output, made in setup (all checks on)
    notes: list[str] = field(default_factory=list)
    # A context manager factory ``(cupy stream) -> context`` that makes the target's library
    # launch on the profiler's stream while it is timed (torch: its current stream); None: CuPy's.
    on_stream: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    setup: Callable[[Any], Prepared]
    requires: Callable[[], str | None] = lambda: None
    supports: Callable[[Any], str | None] = lambda shape: None


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


def setup_flashmla(inp) -> Prepared:
    """The call users make: default arguments (outputs allocated by the call, value checks in
    their current mode), on CuPy arrays; over the FP8 cache with ``is_fp8_kvcache`` and its scale
    (and an e4m3 q's)."""
    from .. import mla

    s = inp.shape
    meta, splits = mla.get_mla_metadata(inp.cache_seqlens, s.s_q * s.h_q // s.h_kv, s.h_kv)
    args = (inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, s.dv, meta, splits)
    fp8 = inp.format_kwargs()

    def run():
        return mla.flash_mla_with_kvcache(*args, causal=s.causal, **fp8)

    return Prepared(run, run())


def _requires_flashmla_torch() -> str | None:
    why = torch_drop_in.torch_unavailable()
    if why:
        return why
    try:
        importlib.import_module("flashmla_cupy.flash_mla")
    except Exception as e:  # noqa: BLE001
        return f"flashmla_cupy.flash_mla (the torch drop-in) unavailable ({_first_line(e)})"
    return None


def _torch_inputs(inp):
    """q, k_cache, block_table, cache_seqlens as torch tensors viewing the CuPy arrays' memory
    (DLPack, zero-copy), made once per shape and shared by the torch targets."""
    if inp.torch_views is None:
        inp.torch_views = tuple(torch_drop_in.from_cupy(x) for x in
                                (inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens))
    return inp.torch_views


def _as_cupy(result):
    """``(out, lse)`` torch tensors as CuPy arrays for --check (float32: exact for bf16/fp16)."""
    import cupy
    return tuple(cupy.from_dlpack(x.float() if x.is_floating_point() else x) for x in result)


def setup_flashmla_torch(inp) -> Prepared:
    """The call torch users make: ``flashmla_cupy.flash_mla`` (FlashMLA's signatures, default
    arguments) on torch tensors, on torch's current stream; over the FP8 cache with its keywords,
    the scales as torch tensors viewing the CuPy ones."""
    s = inp.shape
    q, k_cache, block_table, seqlens = _torch_inputs(inp)
    fp8 = inp.format_kwargs(torch_drop_in.from_cupy)
    with torch_drop_in.cupy_device(inp.q):    # setup runs outside the timed stream
        meta, splits = torch_drop_in.get_mla_metadata(seqlens, s.s_q * s.h_q // s.h_kv, s.h_kv)

        def run():
            return torch_drop_in.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, s.dv, meta, splits,
                                                        causal=s.causal, **fp8)

        result = _as_cupy(run())
    return Prepared(run, result, on_stream=torch_drop_in.cupy_stream)


def import_real_flash_mla():
    """FlashMLA's own module (the top-level ``flash_mla`` package, not ``flashmla_cupy.flash_mla``)."""
    fm = importlib.import_module("flash_mla")
    where = getattr(fm, "__file__", None) or "?"
    for name in ("get_mla_metadata", "flash_mla_with_kvcache"):
        if not callable(getattr(fm, name, None)):
            raise ImportError(f"the flash_mla package at {where} has no {name}")
    if str(getattr(fm.flash_mla_with_kvcache, "__module__", "")).startswith("flashmla_cupy"):
        raise ImportError(f"the flash_mla package at {where} is flashmla-cupy's drop-in, not FlashMLA")
    return fm


def flash_mla_api(fm) -> str:
    """Which generation of FlashMLA's API ``fm`` has: ``"seed"`` (2025-04:
    ``get_mla_metadata(cache_seqlens, s_q*h_q//h_kv, h_kv) -> (metadata, num_splits)``) or
    ``"upstream"`` (9241ae3 and later: ``get_mla_metadata()`` needs no arguments and returns
    ``(FlashMLASchedMeta, None)``, filled by the first ``flash_mla_with_kvcache`` call)."""
    try:
        params = inspect.signature(fm.get_mla_metadata).parameters.values()
    except (TypeError, ValueError):          # a compiled function without a signature: the seed's form
        return "seed"
    required = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return "seed" if any(p.default is inspect.Parameter.empty and p.kind in required for p in params) \
        else "upstream"


def _requires_real_flash_mla() -> str | None:
    why = torch_drop_in.torch_unavailable()
    if why:
        return why
    try:
        import_real_flash_mla()
    except Exception as e:  # noqa: BLE001
        return f"FlashMLA (the flash_mla package) is not importable here ({_first_line(e)})"
    return None


def _real_flash_mla_supports(shape) -> str | None:
    """FlashMLA's dense call reads 16-bit q and caches (its FP8 cache is the sparse call's, read by
    bf16 q) and checks ``page_block_size == 64``."""
    if shape.dtype == FP8_CACHE:        # (an e4m3 q comes with the FP8 cache only)
        return ("FlashMLA has no dense FP8 decoding on Hopper (its FP8 cache is the sparse one, "
                "read by bf16 q)")
    if shape.page_size != PAGE_BLOCK:
        return f"FlashMLA's dense call takes pages of {PAGE_BLOCK} tokens only"
    return None


def setup_real_flash_mla(inp) -> Prepared:
    """FlashMLA's own call on the same buffers (torch tensors), in either API generation
    (``flash_mla_api``); the metadata is computed beforehand in both (upstream: by the first call)."""
    fm = import_real_flash_mla()
    api = flash_mla_api(fm)
    s = inp.shape
    q, k_cache, block_table, seqlens = _torch_inputs(inp)
    with torch_drop_in.cupy_device(inp.q):    # setup runs outside the timed stream
        if api == "seed":
            meta, splits = fm.get_mla_metadata(seqlens, s.s_q * s.h_q // s.h_kv, s.h_kv)
        else:
            meta, splits = fm.get_mla_metadata()[0], None

        def run():
            return fm.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, s.dv, meta, splits, causal=s.causal)

        result = _as_cupy(run())           # upstream: this first call fills the scheduler metadata
    return Prepared(run, result, notes=[_api_note(fm, api)], on_stream=torch_drop_in.cupy_stream)


def _api_note(fm, api: str) -> str:
    version = getattr(fm, "__version__", None)
    return f"FlashMLA {api} API" + (f" (flash_mla {version})" if version else "")


def _requires_cublas() -> str | None:
    from .ceilings import cublas_status
    return cublas_status()


def _cupy_baseline_supports(shape) -> str | None:
    """The plain CuPy implementation upcasts 16-bit q and caches; it has no FP8 dequantization."""
    if shape.dtype == FP8_CACHE:        # (an e4m3 q comes with the FP8 cache only)
        return "the plain CuPy baseline reads bf16/fp16 q and caches only"
    return None


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
    "flashmla": Target("flashmla", "flashmla_cupy.flash_mla_with_kvcache as users call it: CuPy arrays, default "
                                   "arguments (outputs allocated by the call, value checks in their current mode); "
                                   "split-KV + combine kernels (PDL); metadata computed once beforehand",
                       setup_flashmla, _requires_flashmla),
    "flashmla_torch": Target("flashmla_torch", "flashmla_cupy.flash_mla.flash_mla_with_kvcache (the torch drop-in, "
                                               "FlashMLA's signatures) on torch tensors viewing the same buffers, "
                                               "on torch's current stream (the profiler's)",
                             setup_flashmla_torch, _requires_flashmla_torch),
    "flash_mla": Target("flash_mla", "FlashMLA's own flash_mla_with_kvcache (the flash_mla package, nvcc build; "
                                     "seed or upstream API) on the same buffers as torch tensors, same stream; "
                                     "metadata computed once beforehand",
                        setup_real_flash_mla, _requires_real_flash_mla, _real_flash_mla_supports),
    "cupy": Target("cupy", "plain CuPy paged MLA (gather pages, float32 cuBLAS matmuls, softmax): "
                           "the seed benchmark's torch target", setup_cupy_baseline, _requires_cublas,
                   _cupy_baseline_supports),
}
MAIN_MLA_TARGETS = {"cupy": "flashmla", "torch": "flashmla_torch"}     # the timed call, by --inputs


# --------------------------------------------------------------------------------------------
# Sparse decoding (DeepSeek-V3.2, FP8 cache)
# --------------------------------------------------------------------------------------------

def setup_flashmla_sparse(inp) -> Prepared:
    """The sparse call users make: metadata scheduled for ``topk`` tokens per query token, then
    default arguments with the indices and the attention sink."""
    from .. import mla

    s = inp.shape
    meta, splits = mla.get_mla_metadata(inp.cache_seqlens, s.s_q * s.h_q, 1, s.h_q, True, s.topk)

    def run():
        return mla.flash_mla_with_kvcache(inp.q, inp.k_cache, None, None, s.dv, meta, splits, None,
                                          is_fp8_kvcache=True, indices=inp.indices, attn_sink=inp.attn_sink)

    return Prepared(run, run())


def _requires_real_flash_mla_sparse() -> str | None:
    why = _requires_real_flash_mla()
    if why:
        return why
    if flash_mla_api(import_real_flash_mla()) != "upstream":
        return "the flash_mla package has the seed's API, which has no sparse decoding (upstream's has, 2025-09 on)"
    return None


def _real_flash_mla_sparse_supports(shape) -> str | None:
    """FlashMLA's Hopper sparse kernel exists for 64 and 128 query heads only."""
    if shape.h_q not in (64, 128):
        return f"FlashMLA's Hopper sparse decoding takes h_q 64 or 128, not {shape.h_q}"
    return None


def setup_real_flash_mla_sparse(inp) -> Prepared:
    """FlashMLA's own sparse call on the same buffers (torch tensors), upstream API: the metadata is
    filled by this first call."""
    fm = import_real_flash_mla()
    s = inp.shape
    q, k_cache, indices, sink = (torch_drop_in.from_cupy(x) for x in (inp.q, inp.k_cache, inp.indices, inp.attn_sink))
    with torch_drop_in.cupy_device(inp.q):    # setup runs outside the timed stream
        meta = fm.get_mla_metadata()[0]

        def run():
            return fm.flash_mla_with_kvcache(q, k_cache, None, None, s.dv, meta, None, is_fp8_kvcache=True,
                                             indices=indices, attn_sink=sink)

        result = _as_cupy(run())
    return Prepared(run, result, notes=[_api_note(fm, "upstream")], on_stream=torch_drop_in.cupy_stream)


SPARSE_TARGETS: dict[str, Target] = {
    "flashmla": Target("flashmla", "flashmla_cupy.flash_mla_with_kvcache with indices (FP8 cache, attention sink) "
                                   "as users call it: CuPy arrays, outputs allocated by the call, value checks in "
                                   "their current mode; split-KV + combine kernels (PDL); metadata computed once "
                                   "beforehand", setup_flashmla_sparse, _requires_flashmla),
    "flash_mla": Target("flash_mla", "FlashMLA's own flash_mla_with_kvcache with indices (the flash_mla package, "
                                     "upstream API, nvcc build) on the same buffers as torch tensors, same stream; "
                                     "metadata filled by one call beforehand",
                        setup_real_flash_mla_sparse, _requires_real_flash_mla_sparse,
                        _real_flash_mla_sparse_supports),
}
MAIN_SPARSE_TARGET = "flashmla"


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

TARGETS = {"mla": MLA_TARGETS, "sparse": SPARSE_TARGETS, "attention": ATTENTION_TARGETS}     # by profile kind
