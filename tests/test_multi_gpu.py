"""MLA decoding on a second GPU and on two GPUs in one process (needs two Hopper GPUs).

Loaded kernels, their shared-memory attribute, tensor maps, cached call plans, workspaces and
metadata are per device; these tests make sure none of them leaks from one device to the other:

* the whole API on device 1 (``with cupy.cuda.Device(1):``), checked against the reference;
* calls alternating between devices 0 and 1 (some with identical inputs on both, whose results
  must then agree bit for bit), checked only after all were issued; the same from one thread
  per device;
* arrays on a device other than the current one: ValueError naming the argument, before
  anything is launched.
"""
from __future__ import annotations

import dataclasses
import threading

import cupy
import numpy as np
import pytest

import flashmla_cupy
from flashmla_cupy.driver import device_properties
from flashmla_cupy.testing import check_against_reference, make_inputs, poisoned, run_kernel

pytestmark = pytest.mark.hopper


@pytest.fixture(scope="module", autouse=True)
def two_hopper_gpus():
    count = cupy.cuda.runtime.getDeviceCount()
    if count < 2:
        pytest.skip(f"needs 2 GPUs; this machine has {count}")
    for d in (0, 1):
        props = device_properties(d)
        if props["major"] != 9:
            pytest.skip(f"needs two Hopper (sm_90) GPUs; device {d} is {props['name']}")


def on_device(x: cupy.ndarray, device: int) -> cupy.ndarray:
    """A copy of x on ``device``, through the host (2-byte floats moved as their bits)."""
    raw = x.view(np.uint16) if x.dtype.itemsize == 2 else x
    host = cupy.asnumpy(raw)
    with cupy.cuda.Device(device):
        return cupy.asarray(host).view(x.dtype)


def inputs_on_device(inp, device: int):
    """The same inputs (bit for bit) on another device."""
    return dataclasses.replace(inp, q=on_device(inp.q, device), k_cache=on_device(inp.k_cache, device),
                               block_table=on_device(inp.block_table, device),
                               cache_seqlens=on_device(inp.cache_seqlens, device))


def same_gpu_model() -> bool:
    a, b = device_properties(0), device_properties(1)
    return (a["name"], a["sm_count"]) == (b["name"], b["sm_count"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("h_kv", [1, 2])
def test_device_1(dtype, h_kv):
    """Everything on device 1: inputs, metadata, workspace, kernels, outputs and the reference."""
    with cupy.cuda.Device(1):
        rng = np.random.default_rng(10 + h_kv)
        inp = make_inputs(rng, [700, 0, 64, 65, 5000, 1, 20_000], 2, 16 * h_kv, h_kv, dtype)
        assert inp.q.device.id == 1 and inp.k_cache.device.id == 1
        for causal in (False, True):
            metadata, num_splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 2 * 16, h_kv)
            assert metadata.device.id == 1 and num_splits.device.id == 1
            out, lse = run_kernel(inp, causal)
            assert out.device.id == 1 and lse.device.id == 1
            check_against_reference(inp, out, lse, causal, dtype)
            # Without preallocated outputs too (they are then allocated on the current device).
            out2, lse2 = flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens,
                                                              512, metadata, num_splits, causal=causal)
            assert out2.device.id == 1 and lse2.device.id == 1
            assert bool((out2.view(np.uint16) == out.view(np.uint16)).all())
            assert bool((lse2.view(np.uint32) == lse.view(np.uint32)).all())
    assert cupy.cuda.runtime.getDevice() == 0


def _interleaved_inputs(dtype):
    """Per device: a shape that both devices get with identical data ("same"), and one of its own."""
    rng = np.random.default_rng(20)
    with cupy.cuda.Device(0):
        same0 = make_inputs(rng, [700, 0, 64, 5000, 1, 20_000], 2, 32, 1, dtype)
        own0 = make_inputs(rng, [129, 3000, 65, 7], 4, 64, 2, dtype)
    with cupy.cuda.Device(1):
        own1 = make_inputs(rng, [9000, 1, 33, 0, 640], 1, 128, 1, dtype)
    return {(0, "same"): same0, (1, "same"): inputs_on_device(same0, 1), (0, "own"): own0, (1, "own"): own1}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_interleaved_devices(dtype):
    """Calls alternate between the devices (each with its own metadata, plans, tensor maps); the
    results are checked only after every call was issued."""
    inputs = _interleaved_inputs(dtype)
    order = [(0, "same"), (1, "same"), (1, "own"), (0, "own"), (0, "same"), (1, "own"), (1, "same"), (0, "own")]
    results = []
    for round_ in range(2):
        for device, name in order:
            causal = (round_ + device) % 2 == 1
            with cupy.cuda.Device(device):
                out, lse = run_kernel(inputs[device, name], causal)
            results.append((device, name, causal, out, lse))
    for device, name, causal, out, lse in results:
        with cupy.cuda.Device(device):
            assert out.device.id == device and lse.device.id == device
            check_against_reference(inputs[device, name], out, lse, causal, dtype)
    if same_gpu_model():
        # Identical inputs on identical GPUs: identical (deterministic) results.
        by_key = {}
        for device, name, causal, out, lse in results:
            if name == "same":
                bits = (cupy.asnumpy(out.view(np.uint16)), cupy.asnumpy(lse.view(np.uint32)))
                by_key.setdefault(causal, []).append((device, bits))
        for causal, runs in by_key.items():
            assert {d for d, _ in runs} == {0, 1}
            first = runs[0][1]
            for device, bits in runs[1:]:
                assert np.array_equal(bits[0], first[0]) and np.array_equal(bits[1], first[1]), \
                    f"device {device} differs from device {runs[0][0]} on identical inputs (causal={causal})"


def test_one_thread_per_device():
    """One thread per device, each issuing calls and checking them (as a server driving two
    GPUs from two threads would); metadata computed once per device and reused across calls."""
    inputs = _interleaved_inputs("bf16")
    errors = []

    def work(device):
        try:
            with cupy.cuda.Device(device):
                for name in ("same", "own"):
                    inp = inputs[device, name]
                    metadata, num_splits = flashmla_cupy.get_mla_metadata(
                        inp.cache_seqlens, inp.s_q * inp.h_q // inp.h_kv, inp.h_kv)
                    for layer in range(4):
                        causal = layer % 2 == 1
                        b = len(inp.seqlens)
                        out = poisoned((b, inp.s_q, inp.h_q, 512), inp.q.dtype)
                        lse = poisoned((b, inp.h_q, inp.s_q), np.float32)
                        flashmla_cupy.flash_mla_with_kvcache(inp.q, inp.k_cache, inp.block_table, inp.cache_seqlens,
                                                             512, metadata, num_splits, causal=causal, out=out, lse=lse)
                        check_against_reference(inp, out, lse, causal, "bf16")
        except BaseException as e:   # reported by the main thread
            errors.append(f"device {device}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, "\n".join(errors)


# --- arrays on the wrong device ---------------------------------------------------------------

@pytest.fixture(scope="module")
def both_devices():
    """The same call's arguments on device 0 and (copied) on device 1."""
    rng = np.random.default_rng(30)
    with cupy.cuda.Device(0):
        inp0 = make_inputs(rng, [300, 0, 5000], 2, 16, 1, "bf16")
    inp1 = inputs_on_device(inp0, 1)
    args = {}
    for device, inp in ((0, inp0), (1, inp1)):
        with cupy.cuda.Device(device):
            metadata, num_splits = flashmla_cupy.get_mla_metadata(inp.cache_seqlens, 2 * 16, 1)
            args[device] = dict(q=inp.q, k_cache=inp.k_cache, block_table=inp.block_table,
                                cache_seqlens=inp.cache_seqlens, tile_scheduler_metadata=metadata,
                                num_splits=num_splits)
    return inp0, args


def wrong_device(name: str, current: int, other: int) -> str:
    """The error's pattern: it starts with the argument's name and names both devices."""
    return rf"^{name}\b(?=.*\bdevice {current}\b)(?=.*\bdevice {other}\b)"


ARGUMENTS = ["q", "k_cache", "block_table", "cache_seqlens", "tile_scheduler_metadata", "num_splits", "out", "lse"]


@pytest.mark.parametrize("name", ARGUMENTS)
def test_argument_on_other_device(both_devices, name):
    """Device 0 is current and one argument lives on device 1: ValueError naming it, and nothing
    launched (the device-0 outputs keep their NaN poison)."""
    inp0, args = both_devices
    dtype = inp0.q.dtype
    outputs = {}
    for device in (0, 1):
        with cupy.cuda.Device(device):
            outputs[device] = dict(out=poisoned((3, 2, 16, 512), dtype), lse=poisoned((3, 16, 2), np.float32))
    call = {**args[0], **outputs[0]}
    call[name] = (args[1] | outputs[1])[name]
    assert cupy.cuda.runtime.getDevice() == 0
    with pytest.raises(ValueError, match=wrong_device(name, current=0, other=1)):
        flashmla_cupy.flash_mla_with_kvcache(head_dim_v=512, causal=True, **call)
    assert bool(cupy.isnan(outputs[0]["out"].astype(np.float32)).all())
    assert bool(cupy.isnan(outputs[0]["lse"]).all())
    # The failed call left nothing behind: the same call with every argument on device 0 works.
    out, lse = flashmla_cupy.flash_mla_with_kvcache(head_dim_v=512, causal=True, **args[0], **outputs[0])
    check_against_reference(inp0, out, lse, True, "bf16")


def test_metadata_and_workspace_on_other_device(both_devices):
    inp0, args = both_devices
    with cupy.cuda.Device(0):
        with pytest.raises(ValueError, match=wrong_device("cache_seqlens", current=0, other=1)):
            flashmla_cupy.get_mla_metadata(args[1]["cache_seqlens"], 2 * 16, 1)
    with cupy.cuda.Device(1):
        workspace1 = flashmla_cupy.get_mla_workspace(args[1]["q"], args[1]["k_cache"],
                                                     args[1]["tile_scheduler_metadata"])
    with cupy.cuda.Device(0):
        with pytest.raises(ValueError, match=r"workspace"):
            flashmla_cupy.flash_mla_with_kvcache(head_dim_v=512, causal=True, workspace=workspace1, **args[0])


def test_all_arguments_on_the_other_device(both_devices):
    """Device 1 current, every array on device 0 (the reverse direction): the error names the
    first argument checked (q, as the checks go now)."""
    inp0, args = both_devices
    names = "(" + "|".join(ARGUMENTS) + ")"
    with cupy.cuda.Device(1):
        with pytest.raises(ValueError, match=wrong_device(names, current=1, other=0)):
            flashmla_cupy.flash_mla_with_kvcache(head_dim_v=512, causal=True, **args[0])
