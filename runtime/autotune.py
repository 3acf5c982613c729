"""Autotune: the coordinator tries fusion thresholds and cycle times while the job runs, then keeps the best.

Both settings act only on rank 0 (it decides what is fused and when it answers), so tuning
needs no agreement between ranks. Progress is measured as Horovod does: a *step* ends when a
tensor name that was already reduced in the current step comes again (the next training step
has begun), and a *sample* is ``steps_per_sample`` steps under one setting, scored by the bytes
allreduced per second. The first ``warmup_samples`` samples run under the starting settings and
are discarded (caches fill, pages fault in). The search is a coordinate search over a fixed
grid, the fusion threshold first and then the cycle time at the best threshold; samples left
within ``max_samples`` re-measure the best few, and the setting with the best mean score is kept
for the rest of the job. Every sample is a row of the CSV log when one is asked for.
"""

from __future__ import annotations

import csv
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

__all__ = ["Autotuner", "FUSION_CANDIDATES", "CYCLE_CANDIDATES"]

log = logging.getLogger("spark_hvd.runtime")

MiB = 1024 * 1024
FUSION_CANDIDATES: Tuple[int, ...] = (0, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 128 * MiB)
"""Fusion thresholds tried, in bytes (0: no fusion)."""
CYCLE_CANDIDATES: Tuple[float, ...] = (0.0, 0.5, 1.0, 2.5, 5.0)
"""Cycle times tried, in milliseconds (0: answer at once)."""
_REMEASURED = 3
"""How many of the best settings the samples left over measure again."""

Setting = Tuple[int, float]
"""(fusion threshold in bytes, cycle time in ms)."""

LOG_FIELDS = ("sample", "phase", "fusion_threshold_bytes", "cycle_time_ms", "steps", "seconds", "bytes",
              "score_bytes_per_s")


@dataclass
class _Sample:
    steps: int = 0
    nbytes: int = 0
    started: Optional[float] = None


class Autotuner:
    """Chooses the setting each sample runs under; :meth:`observe` is fed every decision."""

    def __init__(self, fusion_threshold: int, cycle_time_ms: float, log_path: Optional[str] = None,
                 warmup_samples: int = 3, steps_per_sample: int = 10, max_samples: int = 20,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        for name, value, low in (("warmup_samples", warmup_samples, 0), ("steps_per_sample", steps_per_sample, 1),
                                 ("max_samples", max_samples, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"autotune {name}={value!r} is invalid: expected an int >= {low}")
        self.start: Setting = (int(fusion_threshold), float(cycle_time_ms))
        self.current: Setting = self.start
        self.warmup_left = warmup_samples
        self.steps_per_sample = steps_per_sample
        self.max_samples = max_samples
        self.scores: Dict[Setting, List[float]] = {}
        self.samples_taken = 0
        self.done = False
        self._clock = clock
        self._plan: List[Setting] = [(f, self.start[1]) for f in FUSION_CANDIDATES]
        self._phase = "warmup" if warmup_samples else "fusion"
        self._sample = _Sample()
        self._seen: Set[str] = set()
        self._log_path = log_path
        self._log_rows = 0
        if log_path:
            directory = os.path.dirname(os.path.abspath(log_path))
            if not os.path.isdir(directory):
                raise ValueError(f"autotune log file {log_path!r} is in a folder that does not exist: expected a "
                                 f"path in an existing folder; create {directory} or pick another file")
            with open(log_path, "w", newline="") as handle:
                csv.writer(handle).writerow(LOG_FIELDS)
        if not warmup_samples:
            self.current = self._plan.pop(0)

    @property
    def best(self) -> Setting:
        """The setting with the best mean score so far (the starting one before any trial)."""
        if not self.scores:
            return self.start
        return max(self.scores, key=lambda s: (sum(self.scores[s]) / len(self.scores[s]), -s[1], s[0]))

    def observe(self, names: Iterable[str], nbytes: int) -> Optional[Setting]:
        """Account one decision's allreduced ``names`` and bytes; the setting to switch to when it changes."""
        if self.done:
            return None
        now = self._clock()
        sample = self._sample
        if sample.started is None:
            sample.started = now
            self._seen = set(names)
            return None  # the sample is timed from its first decision; that decision's bytes are not counted
        sample.nbytes += nbytes
        repeated = False
        for name in names:
            if name in self._seen:
                repeated = True
            self._seen.add(name)
        if not repeated:
            return None
        sample.steps += 1
        self._seen = set(names)
        if sample.steps < self.steps_per_sample:
            return None
        return self._finish(now)

    def _finish(self, now: float) -> Optional[Setting]:
        sample = self._sample
        assert sample.started is not None
        seconds = max(now - sample.started, 1e-9)
        score = sample.nbytes / seconds
        phase = self._phase
        self.samples_taken += 1
        self._log(phase, sample, seconds, score)
        self._sample = _Sample()
        if phase == "warmup":
            self.warmup_left -= 1
            if self.warmup_left > 0:
                return None
            self._phase = "fusion"
        else:
            self.scores.setdefault(self.current, []).append(score)
        return self._next()

    def _next(self) -> Optional[Setting]:
        trials = sum(len(v) for v in self.scores.values())
        if self._plan and trials < self.max_samples:
            return self._switch(self._plan.pop(0))
        if self._phase == "fusion":
            fusion = self.best[0]
            self._phase = "cycle"
            self._plan = [(fusion, c) for c in CYCLE_CANDIDATES if (fusion, c) not in self.scores]
            return self._next()
        if self._phase == "cycle":
            self._phase = "remeasure"
            ranked = sorted(self.scores, key=lambda s: -sum(self.scores[s]) / len(self.scores[s]))
            left = self.max_samples - trials
            self._plan = (ranked[:_REMEASURED] * max(0, left))[:max(0, left)]
            if self._plan:
                return self._next()
        return self._conclude()

    def _conclude(self) -> Optional[Setting]:
        self.done = True
        best = self.best
        mean = sum(self.scores[best]) / len(self.scores[best]) if best in self.scores else 0.0
        log.info("spark-hvd autotune: keeping fusion_threshold=%d bytes, cycle_time_ms=%g (%.3g bytes/s)",
                 best[0], best[1], mean)
        self._log("best", _Sample(), 0.0, mean, best)
        return self._switch(best)

    def _switch(self, setting: Setting) -> Optional[Setting]:
        changed = setting != self.current
        self.current = setting
        return setting if changed else None

    def _log(self, phase: str, sample: _Sample, seconds: float, score: float,
             setting: Optional[Setting] = None) -> None:
        if not self._log_path:
            return
        fusion, cycle = setting or self.current
        row = ["" if phase == "best" else self.samples_taken, phase, fusion, cycle, sample.steps, f"{seconds:.6f}",
               sample.nbytes, f"{score:.1f}"]
        try:
            with open(self._log_path, "a", newline="") as handle:
                csv.writer(handle).writerow(row)
        except OSError as exc:  # tuning goes on; the log is a report, not a dependency
            log.warning("spark-hvd autotune: cannot write %s (%s); logging stops", self._log_path, exc)
            self._log_path = None
