"""Bad argument values found by the kernels, reported without synchronizing the host.

Shapes, dtypes and layouts are checked on the host before anything runs. *Values* (sequence
lengths, block ids, the scheduler's metadata) live on the GPU; reading them on the host would
synchronize every call. Instead the kernels check every value they use and never touch memory
outside an array because of one: a request with a bad value gets NaN in its ``out`` and ``lse``
rows and the others are computed as usual. The first bad value is recorded in a small error
record in mapped pinned memory, one per device, which the host reads without synchronizing.

Modes (``set_value_checks``, ``value_checks``, environment ``FLASHMLA_CUPY_VALUE_CHECKS``):

* ``"async"`` (default): like CUDA's own asynchronous errors, a recorded error is raised as a
  ``ValueError`` by the next flashmla_cupy call on that device after the kernel that found it
  has run (or by ``check_errors()``, which synchronizes first). The message names the argument,
  the index and the value.
* ``"sync"``: each call synchronizes its stream after launching and raises at the call itself
  (for debugging; not during CUDA-graph capture, where synchronizing is not allowed).
* ``"off"``: nothing is recorded or raised; the kernels stay memory-safe and still write NaN.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading

import cupy

from . import constants
from .driver import check, driver, relaxed_capture_mode

MODES = ("async", "sync", "off")
_ALIASES = {"1": "async", "on": "async", "true": "async", "0": "off", "false": "off"}

# Record layout (int32 x 8), written by cuda_src/common/error.cuh:
# [code, claimed, index0, index1, value, bound, -, -]
RECORD_INTS = 8
_CODE, _CLAIMED, _INDEX0, _INDEX1, _VALUE, _BOUND = range(6)


def _parse_mode(mode) -> str:
    if mode is True or mode is False:
        return "async" if mode else "off"
    if isinstance(mode, str):
        m = mode.strip().lower()
        m = _ALIASES.get(m, m)
        if m in MODES:
            return m
    raise ValueError(f"value check mode must be one of {', '.join(MODES)} (or True/False); got {mode!r}")


def _mode_from_environment() -> str:
    raw = os.environ.get("FLASHMLA_CUPY_VALUE_CHECKS", "async")
    try:
        return _parse_mode(raw)
    except ValueError:
        raise ValueError(f"FLASHMLA_CUPY_VALUE_CHECKS must be one of {', '.join(MODES)}; got {raw!r}") from None


_mode = _mode_from_environment()


def set_value_checks(mode) -> None:
    """Set how bad values are reported: ``"async"`` (default), ``"sync"`` or ``"off"`` (True and
    False mean ``"async"`` and ``"off"``). Module-wide."""
    global _mode
    _mode = _parse_mode(mode)


def value_check_mode() -> str:
    return _mode


@contextlib.contextmanager
def value_checks(mode):
    """Context manager form of ``set_value_checks``."""
    global _mode
    previous, _mode = _mode, _parse_mode(mode)
    try:
        yield
    finally:
        _mode = previous


_ROW_ERRORS = (constants.ERROR_SEQLEN_NEGATIVE, constants.ERROR_SEQLEN_RANGE, constants.ERROR_BLOCK_ID)


class ErrorRecord:
    """One device's record: 32 bytes of pinned host memory mapped into the device's address
    space. The host reads ``words`` directly (no CUDA call)."""

    def __init__(self, device_id: int):
        drv = driver()
        flags = drv.CU_MEMHOSTALLOC_PORTABLE | drv.CU_MEMHOSTALLOC_DEVICEMAP
        nbytes = RECORD_INTS * 4
        with cupy.cuda.Device(device_id), relaxed_capture_mode():   # may run during a capture
            self.host_ptr = int(check(drv.cuMemHostAlloc(nbytes, flags)))
            self.device_ptr = int(check(drv.cuMemHostGetDevicePointer(self.host_ptr, 0)))
        self.device_id = device_id
        self.words = (ctypes.c_int32 * RECORD_INTS).from_address(self.host_ptr)
        ctypes.memset(self.host_ptr, 0, nbytes)

    def take(self) -> ValueError | None:
        """The recorded error as an exception (and the record cleared), or None."""
        w = self.words
        code = w[_CODE]
        if not code:
            return None
        # A bad length or block id spoils its request's rows (NaN); metadata of another batch or
        # call leaves parts of the work undone, so nothing of that call's output can be trusted.
        spoiled = ("affected out/lse rows are NaN" if code in _ROW_ERRORS else "out and lse are not valid")
        error = ValueError(describe(code, w[_INDEX0], w[_INDEX1], w[_VALUE], w[_BOUND]) +
                           f" (found on device {self.device_id} by a kernel of an earlier flashmla_cupy call, "
                           f"whose {spoiled}; see 'Value checks' in the README)")
        w[_CODE] = 0
        w[_CLAIMED] = 0
        return error


def describe(code: int, index0: int, index1: int, value: int, bound: int) -> str:
    if code == constants.ERROR_SEQLEN_NEGATIVE:
        return f"cache_seqlens[{index0}] must be >= 0; got {value}"
    if code == constants.ERROR_SEQLEN_RANGE:
        # index1: k_cache's page block size; bound: block_table's columns.
        return (f"cache_seqlens[{index0}] must be in [0, {bound * index1}] (block_table holds {bound} pages "
                f"of {index1} tokens per request); got {value}")
    if code == constants.ERROR_BLOCK_ID:
        return (f"block_table[{index0}, {index1}] must be a block of k_cache (0 <= id < {bound}), since "
                f"request {index0} uses it; got {value}")
    if code == constants.ERROR_SCHEDULE:
        return (f"tile_scheduler_metadata and num_splits must come from get_mla_metadata of this batch "
                f"(request {index0}: split {value} outside [0, {bound}))")
    if code == constants.ERROR_METADATA_KIND:
        # index0: the SM part whose row was read; value: the topk recorded in it (-1: dense);
        # bound: this call's topk (indices' last dimension; -1: a dense call).
        start = "tile_scheduler_metadata and num_splits must come from get_mla_metadata for this call: "
        call = (f"this sparse call needs topk={bound} (indices' last dimension)" if bound >= 0 else
                "this call is dense (no indices)")
        if value == -1:
            return start + f"they were computed for dense decoding (no topk); {call}"
        if value < 1:
            return start + f"they were not computed by it (row {index0} records topk {value}); {call}"
        return start + f"they were computed for sparse decoding with topk={value}; {call}"
    return f"unknown error code {code} (index {index0}, {index1}, value {value}, bound {bound})"


_records: dict[int, ErrorRecord] = {}
_records_lock = threading.Lock()


def record(device_id: int) -> ErrorRecord:
    """The device's error record (allocated on first use)."""
    rec = _records.get(device_id)
    if rec is None:
        with _records_lock:
            rec = _records.get(device_id)
            if rec is None:
                rec = _records[device_id] = ErrorRecord(device_id)
    return rec


def kernel_pointer(rec: ErrorRecord) -> int:
    """What the kernels get: the record's device address, or 0 (record nothing) when off."""
    return 0 if _mode == "off" else rec.device_ptr


def raise_pending(rec: ErrorRecord) -> None:
    """Raise the error the device recorded since the last report, if any (no synchronization)."""
    if rec.words[_CODE]:
        error = rec.take()
        if error is not None and _mode != "off":
            raise error


def after_launch(rec: ErrorRecord, stream_ptr: int) -> None:
    """In ``"sync"`` mode: wait for the stream and raise what its kernels found."""
    if _mode == "sync":
        from .driver import is_capturing
        if not is_capturing(stream_ptr):
            cupy.cuda.runtime.streamSynchronize(stream_ptr)
            raise_pending(rec)


def check_errors() -> None:
    """Synchronize every device that flashmla_cupy has used and raise the first bad value its
    kernels recorded (``ValueError``), if any."""
    for device_id, rec in list(_records.items()):
        with cupy.cuda.Device(device_id):
            cupy.cuda.runtime.deviceSynchronize()
        error = rec.take()
        if error is not None:
            raise error
