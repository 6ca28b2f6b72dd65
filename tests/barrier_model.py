"""An mbarrier for the CPU models of the kernels' hand-offs (test_narrow_ring.py,
test_loader_handoff.py): arrivals and transaction bytes complete a phase; waits test its parity,
as mbarrier.try_wait.parity does, so a waiter two phases behind waits for ever."""
from __future__ import annotations


class Barrier:
    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, tx: int = 0) -> None:
        assert self.pending > 0, "an arrival on a phase that has none left"
        self.pending -= 1
        self.tx += tx
        self._advance()

    def complete_tx(self, tx: int) -> None:
        self.tx -= tx
        self._advance()

    def _advance(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def passed(self, parity: int) -> bool:   # mbarrier.try_wait.parity
        return (self.phase & 1) != parity


def failing_runs(run, times: int) -> int:
    """How many of ``times`` calls of ``run()`` fail an assertion: a model catching a design that
    the kernel does not have."""
    failures = 0
    for _ in range(times):
        try:
            run()
        except AssertionError:
            failures += 1
    return failures
