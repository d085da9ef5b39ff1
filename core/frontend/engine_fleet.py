"""The API server's view of its engines (one per data-parallel rank): which of them serve,
how many requests each has in flight, and the figures each last reported to this API
server."""

from __future__ import annotations

from plugserve.messages import COUNTER_FIELDS, SchedulerStats, add_stats

# The figures that describe an engine's present (the others count since its start).
_GAUGE_FIELDS = ("num_running", "num_waiting", "num_kv_blocks", "num_free_kv_blocks")


class EngineFleet:
    def __init__(self, num_engines: int) -> None:
        self.num_engines = num_engines
        # In-flight requests per engine: new requests go to the least loaded one.
        self.load = [0] * num_engines
        # Engines that exited or failed, with why: none is sent anything more. `leaving`
        # takes one at once (its exit seen), `retired` once its requests have failed.
        self.leaving: dict[int, str] = {}
        self.retired: dict[int, str] = {}
        self._stats = [SchedulerStats() for _ in range(num_engines)]

    def serves(self, engine: int) -> bool:
        return engine not in self.leaving

    def serving(self) -> list[int]:
        return [i for i in range(self.num_engines) if i not in self.leaving]

    def pick(self) -> int:
        """The serving engine with the fewest requests in flight."""
        return min(self.serving(), key=self.load.__getitem__)

    @property
    def all_gone(self) -> str | None:
        """Why the last engine left, once every one has (else None)."""
        if len(self.leaving) == self.num_engines:
            return next(reversed(self.leaving.values()))
        return None

    def retire(self, engine: int, reason: str) -> None:
        """`engine` is out of service for `reason`; its last figures no longer describe
        anything that runs."""
        self.leaving[engine] = reason  # its last words, where they came first
        self.retired[engine] = reason
        stats = self._stats[engine]
        stats.num_running = stats.num_waiting = 0
        stats.num_kv_blocks = stats.num_free_kv_blocks = 0

    def record_stats(self, engine: int, stats: SchedulerStats) -> None:
        add_stats(self._stats[engine], stats)

    def summed_stats(self) -> SchedulerStats:
        """Every engine's figures summed, as of its latest message to this API server."""
        total = SchedulerStats()
        for s in self._stats:
            for name in (*_GAUGE_FIELDS, *COUNTER_FIELDS):
                setattr(total, name, getattr(total, name) + getattr(s, name))
            for reason, n in s.num_finished.items():
                total.num_finished[reason] = total.num_finished.get(reason, 0) + n
        if total.num_kv_blocks:
            total.kv_usage = 1.0 - total.num_free_kv_blocks / total.num_kv_blocks
        return total
