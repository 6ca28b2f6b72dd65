"""flashmla_cupy.flash_mla, the drop-in for FlashMLA's torch functions.

* FlashMLA's own test at the seed's commit (tests/seed_flash_mla.py, its import pointed at the
  drop-in) runs in a subprocess, bf16 and fp16 (it sets torch's default device and dtype).
* A decode step captured in ``torch.cuda.graph`` the way vLLM and SGLang capture decoding: static
  input and metadata buffers, rewritten in place before each replay (fresh q, cache pages, block
  table and lengths; metadata recomputed outside the graph and copied in), every output element
  checked against the float64 reference.
* The helpers for code that mixes CuPy and torch: views, the device, one stream for both.
* CPU tests (run everywhere): the module imports without torch and says what is missing when
  called; FlashMLA's signatures; tensors that are not on a CUDA device are refused.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _torch_with_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA device")
    return torch


# --- FlashMLA's own test ---------------------------------------------------------------------------

@pytest.mark.hopper
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_flashmla_seed_test_passes(dtype):
    _torch_with_cuda()
    pytest.importorskip("triton", reason="FlashMLA's test times with triton.testing.do_bench")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(REPO / "tests" / "seed_flash_mla.py"), "--dtype", dtype],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"FlashMLA's test failed ({dtype}, exit {result.returncode}):\n{output[-4000:]}"
    # 3 lengths x 4 head counts x 2 s_q x fixed/varied lengths, each checked then timed.
    assert output.count("TFLOPS") == 48, f"expected 48 checked and timed shapes:\n{output[-4000:]}"


# --- torch.cuda.graph, the way inference engines capture decoding -----------------------------------

GRAPH_CASES = [
    # dtype, s_q, h_q, h_kv, causal, capture stream: torch's own capture stream, or the warm-up
    # stream (vLLM and SGLang warm up and capture on one stream of theirs)
    ("bf16", 1, 128, 1, False, "torch"),
    ("fp16", 2, 16, 1, True, "warmup"),
    ("bf16", 2, 32, 2, True, "torch"),
]


@pytest.mark.hopper
@pytest.mark.parametrize("dtype,s_q,h_q,h_kv,causal,capture", GRAPH_CASES,
                         ids=[f"{d}-sq{s}-hq{h}-hkv{k}-{'causal' if c else 'full'}-capture_on_{w}"
                              for d, s, h, k, c, w in GRAPH_CASES])
def test_torch_cuda_graph_replays_with_updated_inputs(dtype, s_q, h_q, h_kv, causal, capture):
    torch = _torch_with_cuda()
    import cupy

    import flashmla_cupy
    from flashmla_cupy import flash_mla
    from flashmla_cupy.testing import DTYPES, PAGE, MLACase, check_against_reference, make_inputs

    rng = np.random.default_rng()
    batch, max_len, spare_blocks, garbage_columns = 9, 2000, 3, 2
    pages = -(-max_len // PAGE)
    heads_per_kv = s_q * h_q // h_kv
    device = torch.device("cuda", cupy.cuda.runtime.getDevice())
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    # Static buffers, as an engine keeps them, with room for the longest requests.
    q = torch.empty((batch, s_q, h_q, 576), dtype=torch_dtype, device=device)
    k_cache = torch.empty((batch * pages + spare_blocks, PAGE, h_kv, 576), dtype=torch_dtype, device=device)
    block_table = torch.empty((batch, pages + garbage_columns), dtype=torch.int32, device=device)
    seqlens = torch.empty((batch,), dtype=torch.int32, device=device)

    def bits(t):
        """A CuPy view of a torch tensor's memory (16-bit floats as int16: no dtype conversion)."""
        return cupy.from_dlpack(t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t)

    def typed(t):
        return bits(t).view(DTYPES[dtype]) if t.dtype == torch_dtype else bits(t)

    def draw_lengths():
        lengths = rng.integers(1, max_len + 1, batch)
        lengths[rng.integers(batch)] = max_len
        lengths[rng.integers(batch)] = 0
        return lengths.astype(np.int32)

    def write_step(meta=None, splits=None):
        """One decoding step's data written into the static buffers: fresh q, the requests' pages
        at permuted block ids with NaN in every slot that no request may read, garbage block ids
        past each request's pages, new lengths; the metadata recomputed outside the graph and
        copied into its static buffers. Returns the case as CuPy views of the static buffers."""
        case = make_inputs(rng, draw_lengths(), s_q, h_q, h_kv, dtype, spare_blocks=spare_blocks,
                           garbage_columns=garbage_columns)
        used_blocks, columns = case.k_cache.shape[0], case.block_table.shape[1]
        k_cache.fill_(float("nan"))
        block_table.fill_(2**31 - 1)
        torch.cuda.synchronize()
        bits(k_cache)[:used_blocks] = case.k_cache.view(np.int16)
        bits(block_table)[:, :columns] = case.block_table
        bits(q)[...] = case.q.view(np.int16)
        bits(seqlens)[...] = case.cache_seqlens
        cupy.cuda.Device().synchronize()
        new_meta, new_splits = flash_mla.get_mla_metadata(seqlens, heads_per_kv, h_kv)
        if meta is not None:
            meta.copy_(new_meta)
            splits.copy_(new_splits)
        static = MLACase(typed(q), typed(k_cache), typed(block_table), typed(seqlens), case.seqlens, s_q, h_q, h_kv)
        return static, new_meta, new_splits

    def check(case, out, lse, what):
        assert out.shape == (batch, s_q, h_q, 512) and out.dtype == torch_dtype and out.is_contiguous(), what
        assert lse.shape == (batch, h_q, s_q) and lse.dtype == torch.float32 and lse.is_contiguous(), what
        try:
            check_against_reference(case, typed(out), bits(lse), causal, dtype)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None

    def call():
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, splits, causal=causal)

    case, meta, splits = write_step()          # the first step's metadata become the static buffers
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):              # warm-up on a side stream, as torch's docs advise
        eager = call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    check(case, *eager, "eager warm-up call")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side if capture == "warmup" else None):
        out, lse = call()

    for step in range(3):
        case, _, _ = write_step(meta, splits)
        out.fill_(float("nan"))                # anything the replay does not write stays NaN
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(case, out, lse, f"replay {step} (lengths {case.seqlens.tolist()})")
    flashmla_cupy.check_errors()


# --- CPU tests ---------------------------------------------------------------------------------------

@pytest.mark.hopper
def test_sparse_decoding_from_torch_matches_the_cupy_call():
    """DeepSeek-V3.2 sparse decoding through the drop-in: the same bytes as the CuPy call (which
    tests/test_sparse.py checks against the reference), torch's outputs and workspace."""
    torch = _torch_with_cuda()
    import cupy
    import ml_dtypes

    import flashmla_cupy
    from flashmla_cupy import flash_mla, quant

    rng = np.random.default_rng(3)
    b, s_q, h_q, topk, page, blocks = 3, 2, 64, 320, 64, 8
    kv = rng.standard_normal((blocks * page, 576)).astype(ml_dtypes.bfloat16)
    cache = quant.quantize_fp8_sparse(kv).reshape(blocks, page, 1, 656)
    ids = rng.integers(-50, blocks * page, size=(b, s_q, topk)).astype(np.int32)
    q = rng.standard_normal((b, s_q, h_q, 576)).astype(np.float32)
    sink = rng.standard_normal(h_q).astype(np.float32)
    lengths = np.array([0, 100, topk], dtype=np.int32)

    t = {name: torch.from_numpy(x).cuda() for name, x in
         (("cache", cache), ("ids", ids), ("sink", sink), ("lengths", lengths), ("seqlens", np.zeros(b, np.int32)))}
    t["q"] = torch.from_numpy(q).cuda().to(torch.bfloat16)
    meta, splits = flash_mla.get_mla_metadata(t["seqlens"], s_q * h_q, 1, h_q, True, topk)
    out, lse = flash_mla.flash_mla_with_kvcache(t["q"], t["cache"], None, None, 512, meta, splits,
                                                is_fp8_kvcache=True, indices=t["ids"], attn_sink=t["sink"],
                                                topk_length=t["lengths"])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    c = {name: cupy.asarray(x.cpu().numpy()) for name, x in t.items() if name != "q"}
    c_q = cupy.asarray(q.astype(ml_dtypes.bfloat16))
    c_meta, c_splits = flashmla_cupy.get_mla_metadata(c["seqlens"], s_q * h_q, 1, h_q, True, topk)
    c_out, c_lse = flashmla_cupy.flash_mla_with_kvcache(c_q, c["cache"], None, None, 512, c_meta, c_splits,
                                                        is_fp8_kvcache=True, indices=c["ids"], attn_sink=c["sink"],
                                                        topk_length=c["lengths"])
    torch.cuda.synchronize()
    assert np.array_equal(out.view(torch.int16).cpu().numpy(), cupy.asnumpy(c_out).view(np.int16))
    assert np.array_equal(lse.cpu().numpy(), cupy.asnumpy(c_lse))
    assert np.isinf(cupy.asnumpy(c_lse)[0]).all() and np.isfinite(cupy.asnumpy(c_lse)[1:]).all()


@pytest.mark.hopper
@pytest.mark.parametrize("dtype", ["fp8", "fp8q"])
def test_dense_fp8_cache_from_torch_matches_the_cupy_call(dtype):
    """The dense FP8 cache through the drop-in (a uint8 cache of e4m3 codes, vLLM's k_scale; q
    bf16, or torch.float8_e4m3fn with q_scale): the same bytes as the CuPy call, which
    tests/test_fp8.py checks against the reference."""
    torch = _torch_with_cuda()
    import cupy

    import flashmla_cupy
    from flashmla_cupy import flash_mla, testing

    inp = testing.make_inputs(np.random.default_rng(4), [0, 100, 700], 2, 64, 1, dtype, page_size=16)
    meta, splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 2 * 64, 1)
    c_out, c_lse = flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens, 512,
                                                        meta, splits, causal=True, **inp.cache_kwargs())
    t = {name: torch.from_numpy(cupy.asnumpy(x)).cuda() for name, x in (
        ("cache", inp.k_cache), ("table", inp.block_table), ("seqlens", inp.cache_seqlens),
        ("scale", inp.k_scale.reshape(1)), ("q", inp.q.view(np.uint8 if dtype == "fp8q" else np.int16)))}
    if dtype == "fp8q":
        q, scales = t["q"].view(torch.float8_e4m3fn), {"q_scale": torch.full((1,), testing.FP8_Q_SCALE).cuda()}
    else:
        q, scales = t["q"].view(torch.bfloat16), {}
    t_meta, t_splits = flash_mla.get_mla_metadata(t["seqlens"], 2 * 64, 1)
    out, lse = flash_mla.flash_mla_with_kvcache(q, t["cache"], t["table"], t["seqlens"], 512, t_meta, t_splits,
                                                causal=True, is_fp8_kvcache=True, k_scale=t["scale"], **scales)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert np.array_equal(out.view(torch.int16).cpu().numpy(), cupy.asnumpy(c_out).view(np.int16))
    assert np.array_equal(lse.cpu().numpy(), cupy.asnumpy(c_lse))


@pytest.mark.gpu
def test_cupy_arrays_and_streams_seen_from_torch():
    """from_cupy views the CuPy array's memory; inside cupy_stream torch's work is queued on the
    CuPy stream, ordered with CuPy's work there; cupy_device makes the array's device current."""
    torch = _torch_with_cuda()
    import cupy

    from flashmla_cupy import flash_mla

    assert flash_mla.torch_unavailable() is None
    a0 = np.random.default_rng(0).standard_normal(1 << 20, dtype=np.float32)
    a = cupy.asarray(a0)
    view = flash_mla.from_cupy(a)
    assert view.data_ptr() == a.data.ptr and view.device.index == a.device.id
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, flash_mla.cupy_device(a), flash_mla.cupy_stream(stream):
        assert torch.cuda.current_device() == a.device.id
        assert torch.cuda.current_stream().cuda_stream == stream.ptr
        a *= 2                       # CuPy, then torch, then CuPy on the one stream: no waits needed
        view.add_(1)
        b = a * 3
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(b), (a0 * np.float32(2) + np.float32(1)) * np.float32(3))


def test_module_imports_without_torch_and_says_what_is_missing():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None          # `import torch` raises ImportError\n"
        "import flashmla_cupy.flash_mla as m\n"
        "for call in (lambda: m.get_mla_metadata(None, 16, 1),\n"
        "             lambda: m.flash_mla_with_kvcache(None, None, None, None, 512, None, None)):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as e:\n"
        "        print('ImportError:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2, result.stdout
    for line in lines:
        assert line.startswith("ImportError: flashmla_cupy.flash_mla works on torch tensors and needs PyTorch"), line


def test_torch_unavailable_names_the_cause():
    code = ("import sys\n"
            "sys.modules['torch'] = None\n"
            "import flashmla_cupy.flash_mla as m\n"
            "print(m.torch_unavailable())\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(("torch is not importable (ImportError: ",
                                             "torch is not importable (ModuleNotFoundError: ")), result.stdout


def test_module_does_not_import_torch():
    code = "import sys, flashmla_cupy, flashmla_cupy.flash_mla; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_signatures_are_flashmlas():
    from flashmla_cupy import flash_mla

    def described(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    empty = inspect.Parameter.empty
    # FlashMLA's, with the sparse (DeepSeek-V3.2) arguments of its later releases, and the dense
    # FP8 cache's and an e4m3 q's scales (keyword only, vLLM's names)
    assert described(flash_mla.get_mla_metadata) == [
        ("cache_seqlens", empty), ("num_heads_per_head_k", empty), ("num_heads_k", empty), ("num_heads_q", None),
        ("is_fp8_kvcache", False), ("topk", None)]
    assert described(flash_mla.flash_mla_with_kvcache) == [
        ("q", empty), ("k_cache", empty), ("block_table", empty), ("cache_seqlens", empty), ("head_dim_v", empty),
        ("tile_scheduler_metadata", empty), ("num_splits", empty), ("softmax_scale", None), ("causal", False),
        ("is_fp8_kvcache", False), ("indices", None), ("attn_sink", None), ("topk_length", None), ("k_scale", None),
        ("q_scale", None)]


def test_tensors_off_the_gpu_are_refused():
    torch = pytest.importorskip("torch")
    from flashmla_cupy import flash_mla

    seqlens = torch.full((2,), 100, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"cache_seqlens must be a CUDA torch\.Tensor; got one on cpu"):
        flash_mla.get_mla_metadata(seqlens, 16, 1)
    with pytest.raises(TypeError, match=r"cache_seqlens must be a CUDA torch\.Tensor; got numpy\.ndarray"):
        flash_mla.get_mla_metadata(np.full(2, 100, dtype=np.int32), 16, 1)
    q = torch.zeros((2, 1, 16, 576), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"q must be a CUDA torch\.Tensor; got one on cpu"):
        flash_mla.flash_mla_with_kvcache(q, q, seqlens, seqlens, 512, seqlens, seqlens)
