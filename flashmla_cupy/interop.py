"""Streams and arrays from other libraries, on the per-call path.

* ``stream_handle``: the ``stream=`` argument of the public functions as a raw ``cudaStream_t``.
* ``torch_tensor_type``: torch's tensor class if torch is already imported (never imports it).
  torch tensors get a fast path of their own in ``plan``: their pointer, shape and strides are
  read directly (a DLPack conversion per argument would cost tens of microseconds per call).
* ``wait_for_torch``: order a launch stream after torch's current stream (what DLPack's stream
  handshake does), for torch tensors handed to the CuPy API without ``stream=``.
* ``data_pointer``, ``device_view_of``: device addresses and CuPy views of raw memory.
"""
from __future__ import annotations

import contextlib
import sys

import cupy
import numpy as np


_CUPY_STREAMS = (cupy.cuda.Stream, cupy.cuda.ExternalStream)   # ExternalStream: CuPy 13


def stream_handle(stream) -> int:
    """``stream`` as a raw handle: None (CuPy's current stream), a ``cupy.cuda.Stream``, an int
    handle, an object with ``cuda_stream`` (torch) or ``__cuda_stream__`` (the CUDA stream
    protocol)."""
    if stream is None:
        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, _CUPY_STREAMS):
        return stream.ptr
    if isinstance(stream, int) and not isinstance(stream, bool):
        if stream < 0:
            raise ValueError(f"stream must be a non-negative CUDA stream handle; got {stream}")
        return stream
    handle = getattr(stream, "cuda_stream", None)
    if isinstance(handle, int):
        return handle
    if hasattr(stream, "__cuda_stream__"):
        _, handle = stream.__cuda_stream__()
        return int(handle)
    raise TypeError(f"stream must be a cupy.cuda.Stream, a raw stream handle (int), or an object with "
                    f"cuda_stream or __cuda_stream__ (e.g. a torch.cuda.Stream); got {type(stream).__name__}")


class _StreamHandle:
    """A raw handle behind the CUDA stream protocol (for ``cupy.cuda.Stream.from_external``)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def cupy_stream(ptr: int):
    """A CuPy stream object for a raw handle (to make it CuPy's current stream in a ``with``)."""
    if hasattr(cupy.cuda.Stream, "from_external"):        # CuPy >= 14
        return cupy.cuda.Stream.from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr)


def on_stream(ptr: int):
    """Context manager: CuPy's current stream is ``ptr`` (nothing to do if it already is)."""
    if cupy.cuda.get_current_stream().ptr == ptr:
        return contextlib.nullcontext()
    return cupy_stream(ptr)


def torch_tensor_type():
    """``torch.Tensor`` if torch has been imported by someone, else None."""
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None) if torch is not None else None


# The torch helpers below run only for torch tensors, so torch is already imported: they take it
# from sys.modules and never import it themselves.

def torch_dtype(dtype: np.dtype):
    """torch's dtype for a NumPy/ml_dtypes dtype of the MLA arrays (the same names)."""
    return getattr(sys.modules["torch"], np.dtype(dtype).name)


_TORCH_DTYPE_NAMES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")


def numpy_dtype_of_torch(dtype) -> np.dtype | None:
    """The NumPy/ml_dtypes dtype of a torch dtype (None for ones without a counterpart here)."""
    name = str(dtype).removeprefix("torch.")
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    if name == "float8_e4m3fn":         # FP8 caches and q: the kernels read their bytes
        return np.dtype(np.uint8)
    return np.dtype(name) if name in _TORCH_DTYPE_NAMES else None


_torch_events: dict[int, cupy.cuda.Event] = {}


def wait_for_torch(device_id: int, stream_ptr: int) -> None:
    """Make ``stream_ptr`` wait for the work queued so far on torch's current stream of the
    device (skipped when they are the same stream)."""
    producer = sys.modules["torch"].cuda.current_stream(device_id).cuda_stream
    if producer == stream_ptr:
        return
    event = _torch_events.get(device_id)
    if event is None:
        event = _torch_events[device_id] = cupy.cuda.Event(block=False, disable_timing=True)
    cupy.cuda.runtime.eventRecord(event.ptr, producer)
    cupy.cuda.runtime.streamWaitEvent(stream_ptr, event.ptr, 0)


def data_pointer(x) -> int:
    """Device address of a CuPy array, a torch tensor, or anything ``checks.device_view`` takes."""
    if isinstance(x, cupy.ndarray):
        return x.data.ptr
    if hasattr(x, "data_ptr"):
        return int(x.data_ptr())
    from .checks import device_view
    return device_view(x, "alloc(nbytes)'s result").data.ptr


def device_view_of(ptr: int, shape, dtype, owner, device_id: int, strides=None) -> cupy.ndarray:
    """A CuPy array over memory that ``owner`` keeps alive."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    memory = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device_id)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), strides=strides)
