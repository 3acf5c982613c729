"""Where a rank's training steps spend their time: wall time per phase of the step, per epoch.

Off unless ``SPARK_HVD_PROFILE_STEPS=1`` reaches the ranks (e.g. through
``SparkBackend(env=...)``); then each epoch's history entry gets ``profile``: one dict per rank of
milliseconds per step in each phase, with the rank's peak resident memory. The training loops mark
the end of each phase; a phase is the time since the previous mark, so the phases add up to the
step's wall time.
"""

from __future__ import annotations

import resource
import time
from typing import Any, Dict, List, Tuple

__all__ = ["StepProfile", "NoProfile", "step_profile", "TORCH_PHASES", "LIGHTNING_PHASES", "KERAS_PHASES"]

TORCH_PHASES: Tuple[str, ...] = ("wait", "assemble", "to_tensor", "forward", "backward", "allreduce", "optimizer",
                                 "bookkeeping")
"""The phases of a torch step: waiting for the reader's batch, the batch's transformation and
reshaping, numpy to tensors, the forward pass with the loss, backward (gradient hooks start the
allreduces), waiting for the allreduces, the optimizer's update, and the loop's own work (sums,
callbacks, progress)."""

LIGHTNING_PHASES: Tuple[str, ...] = ("input", "forward", "backward", "optimizer", "bookkeeping")
"""The phases of a Lightning step, between its hooks: from the previous step's end to the batch
start (the reader, conversion to tensors, Lightning's loop), ``training_step`` to the loss,
backward, the optimizer step with the wait for the allreduces, and the history's bookkeeping."""

KERAS_PHASES: Tuple[str, ...] = ("input", "train_step", "bookkeeping")
"""The phases of a Keras step, between its batch callbacks: from the previous step's end to the
batch start (the input pipeline, Keras's loop), the compiled train step (forward, backward, the
allreduces and the optimizer in one function), and the history's bookkeeping."""


class StepProfile:
    """Accumulated seconds per phase over the steps of one epoch."""

    enabled = True

    def __init__(self, phases: Tuple[str, ...]) -> None:
        self.phases = phases
        self.seconds: Dict[str, float] = dict.fromkeys(phases, 0.0)
        self.steps = 0
        self._last = time.perf_counter()

    def start(self) -> None:
        """Begin timing: the next phase starts now (call before the epoch's first batch)."""
        self.seconds = dict.fromkeys(self.phases, 0.0)
        self.steps = 0
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """``phase`` ended now."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def step_done(self) -> None:
        self.steps += 1

    def summary(self) -> Dict[str, float]:
        """Milliseconds per step in each phase, ``step`` (their sum) and ``peak_rss_mib``."""
        steps = max(self.steps, 1)
        out = {phase: 1000.0 * total / steps for phase, total in self.seconds.items()}
        out["step"] = sum(out[p] for p in self.phases)
        out["steps"] = float(self.steps)
        out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        return out

    def gathered(self, hvd: Any, size: int, name: str) -> List[Dict[str, float]]:
        """Every rank's :meth:`summary`, in rank order (a collective: every rank calls it, with one ``name``)."""
        mine = self.summary()
        return [mine] if size == 1 else list(hvd.allgather_object(mine, name=name))


class NoProfile:
    """What the loops call when profiling is off: nothing."""

    enabled = False

    def start(self) -> None:
        pass

    def mark(self, phase: str) -> None:
        pass

    def step_done(self) -> None:
        pass


def step_profile(phases: Tuple[str, ...]) -> "StepProfile | NoProfile":
    """A :class:`StepProfile` when ``SPARK_HVD_PROFILE_STEPS`` is on for this process, else a :class:`NoProfile`."""
    from spark_hvd.runtime import config

    return StepProfile(phases) if config.read_setting("profile_steps") else NoProfile()
