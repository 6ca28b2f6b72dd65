"""The SM clock, power draw and clock-event reasons, sampled through NVML while a target's timed
runs execute, so that each row says at what clock it ran and whether the power cap held it down.

Why: a GPU that runs compute-bound calls back to back can reach its power limit, and then the
driver lowers the SM clock (on a lent H200 at 700 W, b 128, s_k 16384, h_q 128, s_q 2: 1.3-1.9 GHz
instead of 1.98, and the call ~20 % slower than at full clock; docs/perf-notes.md §32). Such a
row is bound by power, not by the copy or matmul ceiling, and two kernels compare there by their
work per joule at the clock the cap sets.

NVML comes from cuda-bindings or nvidia-ml-py (nvml.py); without either, rows carry no clock and
the profiler's Clocks line says why.
"""
from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass

from .env import _first_line
from .nvml import SM, Nvml

INTERVAL_S = 0.002

# NVML's clock-event reason bits (nvmlClocksEventReason*).
POWER_CAP_REASONS = 0x4 | 0x80     # SW power cap, HW power brake slowdown
THERMAL_REASONS = 0x20 | 0x40      # SW and HW thermal slowdown


@dataclass(frozen=True)
class Sample:
    sm_mhz: int
    power_w: float
    reasons: int


class _NvmlDevice:
    """One device's readings (nvml.py: cuda.bindings.nvml or pynvml)."""

    def __init__(self, pci_bus_id: str):
        self.nvml = Nvml()
        self.backend = self.nvml.backend
        self._handle = self.nvml.handle(pci_bus_id)

    def read(self) -> Sample:
        n, h = self.nvml, self._handle
        return Sample(n.clock(h, SM), n.power_mw(h) / 1000, n.event_reasons(h))

    def close(self) -> None:
        self.nvml.close()


class ClockSampler:
    """``with sampler.sampling() as run: ...`` samples every ``interval_s`` on a thread (and once at
    each end) while the block runs; ``run.stats()`` then gives the record's clock fields."""

    def __init__(self, device, interval_s: float = INTERVAL_S):
        self.device, self.interval_s = device, interval_s

    @classmethod
    def open(cls, pci_bus_id: str) -> tuple[ClockSampler | None, str]:
        """A sampler for the device at ``pci_bus_id`` and how it samples, or None and why not."""
        try:
            dev = _NvmlDevice(pci_bus_id)
            dev.read()
        except Exception as e:  # noqa: BLE001 - no NVML, no permission, an old binding: no clocks
            return None, f"not sampled (NVML unavailable: {_first_line(e)})"
        return cls(dev), (f"SM clock, power and clock-event reasons sampled every {INTERVAL_S * 1000:g} ms "
                          f"during each target's timed runs (NVML via {dev.backend}); clock: their mean SM "
                          f"MHz, \"cap\" where NVML reported the power cap in most samples")

    def sampling(self) -> _Sampling:
        return _Sampling(self.device, self.interval_s)

    def close(self) -> None:
        self.device.close()


class _Sampling:
    def __init__(self, device, interval_s: float):
        self.device, self.interval_s = device, interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.device.read())

    def __enter__(self) -> _Sampling:
        self.samples.append(self.device.read())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.device.read())
        return False

    def stats(self) -> dict:
        return clock_fields(self.samples)


def clock_fields(samples: list[Sample]) -> dict:
    """A record's clock fields: mean and lowest SM clock (under a power cap the clock moves every
    few ms: the mean is the time average), the median power (NVML's one-second average), and the
    fractions of samples in which the power cap or a thermal slowdown held the clock down."""
    if not samples:
        return {}
    n = len(samples)
    return {
        "sm_clock_mhz": statistics.fmean(s.sm_mhz for s in samples),
        "sm_clock_min_mhz": min(s.sm_mhz for s in samples),
        "power_w": statistics.median(s.power_w for s in samples),
        "power_capped": sum(bool(s.reasons & POWER_CAP_REASONS) for s in samples) / n,
        "thermal_slowdown": sum(bool(s.reasons & THERMAL_REASONS) for s in samples) / n,
        "clock_samples": n,
    }


def clock_note(what: str, fields: dict) -> str:
    """``matmul ceiling at SM 1455 MHz (mean of 40 samples), power-capped in 100 % of them``."""
    capped = fields.get("power_capped", 0)
    return (f"{what} at SM {fields['sm_clock_mhz']:.0f} MHz (mean of {fields['clock_samples']} samples)"
            + (f", power-capped in {100 * capped:.0f} % of them" if capped else ""))


def clock_cell(rec: dict) -> str:
    """``1980`` or ``1455 cap`` (``hot`` for a thermal slowdown) for a row; ``–`` unsampled."""
    mhz = rec.get("sm_clock_mhz")
    if mhz is None:
        return "–"
    held = " cap" if rec.get("power_capped", 0) > 0.5 else " hot" if rec.get("thermal_slowdown", 0) > 0.5 else ""
    return f"{mhz:.0f}{held}"
