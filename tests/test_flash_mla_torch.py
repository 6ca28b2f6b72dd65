"""flashmla_cupy.flash_mla, the drop-in for FlashMLA's torch functions.

* FlashMLA's own test at the seed's commit (tests/seed_flash_mla.py, its import pointed at
  the drop-in) runs in a subprocess, bf16 and fp16 (it sets torch's default device and dtype).
* A decode step captured in ``torch.cuda.graph`` the way vLLM and SGLang capture decoding: static
  input and metadata buffers, updated in place before each replay, every output element checked
  against the float64 reference.
* Without torch, the module imports and says what is missing when called.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.hopper
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_flashmla_seed_test_passes(dtype):
    pytest.importorskip("torch")
    pytest.importorskip("triton", reason="FlashMLA's test times with triton.testing.do_bench")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, str(REPO / "tests" / "seed_flash_mla.py"), "--dtype", dtype],
                            env=env, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"FlashMLA's test failed ({dtype}):\n{output[-4000:]}"
    assert output.count("TFLOPS") == 48, f"expected 48 timed shapes:\n{output[-4000:]}"


@pytest.mark.hopper
@pytest.mark.parametrize("s_q,h_q", [(1, 128), (2, 16)])
def test_torch_cuda_graph_replays_with_updated_inputs(s_q, h_q):
    torch = pytest.importorskip("torch")
    import cupy

    from flashmla_cupy import flash_mla
    from flashmla_cupy.testing import check_against_reference, make_inputs

    rng = np.random.default_rng()
    batch = 11
    max_len = 3000
    # Static buffers, as an engine keeps them: the cache and block table of the longest requests;
    # each round draws new lengths within them, a new q, and recomputes the metadata in place.
    inp = make_inputs(rng, np.full(batch, max_len), s_q, h_q, 1, "bf16")
    q, k_cache, block_table, seqlens = (torch.from_dlpack(x) for x in (inp.q, inp.k_cache, inp.block_table,
                                                                       inp.cache_seqlens))
    meta, splits = flash_mla.get_mla_metadata(seqlens, s_q * h_q, 1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                       # warm-up on a side stream (torch's advice)
        flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, splits, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, meta, splits,
                                                    causal=True)

    for round_ in range(3):
        lengths = rng.integers(1, max_len + 1, batch).astype(np.int32)
        lengths[rng.integers(batch)] = 0
        seqlens.copy_(torch.from_numpy(lengths).cuda())
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(q.dtype))
        new_meta, new_splits = flash_mla.get_mla_metadata(seqlens, s_q * h_q, 1)
        meta.copy_(new_meta)
        splits.copy_(new_splits)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        # The cache's slots past each new length are still real tokens (not NaN): the reference
        # reads only the first `lengths[i]` tokens, so a kernel reading past them would differ.
        inp.cache_seqlens = cupy.asarray(lengths)
        inp.seqlens = lengths
        inp.q = cupy.from_dlpack(q)
        try:
            check_against_reference(inp, cupy.from_dlpack(out), cupy.from_dlpack(lse), True, "bf16")
        except AssertionError as e:
            raise AssertionError(f"replay {round_}: {e}") from None
    import flashmla_cupy
    flashmla_cupy.check_errors()


def test_module_imports_without_torch_and_says_what_is_missing():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import flashmla_cupy.flash_mla as m\n"
        "try:\n"
        "    m.get_mla_metadata(None, 16, 1)\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ImportError: flashmla_cupy.flash_mla works on torch tensors and needs PyTorch" in result.stdout


def test_package_does_not_import_torch():
    code = "import sys, flashmla_cupy, flashmla_cupy.flash_mla; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
