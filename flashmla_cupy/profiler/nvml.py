"""NVML, the driver's management library, for the profiler's environment (driver version, clocks)
and its clock sampling (clocks.py): through cuda-bindings (``cuda.bindings.nvml``, 12.9 and newer)
or, failing that, nvidia-ml-py (``pynvml``). Devices are found by PCI bus id, which CUDA and NVML
agree on (their indices differ under CUDA_VISIBLE_DEVICES).
"""
from __future__ import annotations

SM, MEM = "sm", "mem"


class Nvml:
    """An initialized NVML; ``with Nvml() as n:`` shuts it down at the end. Raises where neither
    binding imports or the driver has no NVML."""

    def __init__(self):
        try:
            from cuda.bindings import nvml as m
            m.init_v2()
            self.backend = "cuda.bindings.nvml"
            clock = {SM: m.ClockType.CLOCK_SM, MEM: m.ClockType.CLOCK_MEM}
            self._shutdown = m.shutdown
            self.driver_version = m.system_get_driver_version
            self.handle = m.device_get_handle_by_pci_bus_id_v2
            self.clock = lambda h, which: m.device_get_clock_info(h, clock[which])
            self.max_clock = lambda h, which: m.device_get_max_clock_info(h, clock[which])
            self.power_mw = m.device_get_power_usage
            self.event_reasons = m.device_get_current_clocks_event_reasons
        except (ImportError, AttributeError):
            import pynvml as m
            m.nvmlInit()
            self.backend = "pynvml"
            clock = {SM: m.NVML_CLOCK_SM, MEM: m.NVML_CLOCK_MEM}
            self._shutdown = m.nvmlShutdown
            self.driver_version = lambda: _text(m.nvmlSystemGetDriverVersion())
            self.handle = lambda pci_bus_id: m.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
            self.clock = lambda h, which: m.nvmlDeviceGetClockInfo(h, clock[which])
            self.max_clock = lambda h, which: m.nvmlDeviceGetMaxClockInfo(h, clock[which])
            self.power_mw = m.nvmlDeviceGetPowerUsage
            self.event_reasons = m.nvmlDeviceGetCurrentClocksEventReasons

    def close(self) -> None:
        self._shutdown()

    def __enter__(self) -> Nvml:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
