"""``ElasticSampler``: a distributed sampler whose epoch survives a change of the world.

Each epoch has one permutation of the dataset (from ``seed`` and the epoch). The part not yet
processed is dealt to the ranks round-robin: rank r takes positions r, r + size, ... of it. Ranks
train in lockstep, so after k samples on every rank the processed part of the epoch is exactly the
first ``k * size`` positions, whoever processed them, the ranks lost since included. ``sync()``
(through the elastic state) folds that count into the epoch's start and deals the rest to the
ranks of the current world, so no sample is skipped or seen twice across a reset.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils.data import Sampler

__all__ = ["ElasticSampler"]


class ElasticSampler(Sampler):
    """Yields this rank's share of the epoch's not-yet-processed samples.

    Arguments:
        dataset: anything with ``len()``.
        shuffle: whether each epoch's order is a seeded permutation (else 0, 1, 2, ...).
        seed: the permutation's seed; every rank must pass the same.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self._start = 0  # positions of the epoch's order processed when the current deal was made
        self._done = 0  # samples this rank has processed since
        self._dealt_to = 1  # the number of ranks the rest was dealt to
        self._indices: List[int] = []
        self._deal()

    # -- the epoch's order and this rank's share ----------------------------------------------------
    def _order(self) -> List[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def _deal(self) -> None:
        from spark_hvd.torch.basics import is_initialized, rank, size

        r, n = (rank(), size()) if is_initialized() else (0, 1)
        self._dealt_to = n
        self._indices = self._order()[self._start:][r::n]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing of it processed yet, a fresh deal."""
        self.epoch = int(epoch)
        self._start = 0
        self._done = 0
        self._deal()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of ``batch_size`` samples as processed by this rank (``batch_idx`` is
        accepted for Horovod compatibility; batches are counted in the order they were served)."""
        if batch_size < 0:
            raise ValueError(f"batch_size={batch_size} is invalid: expected a number of samples >= 0")
        self._done = min(self._done + int(batch_size), len(self._indices))

    def record_indices(self, indices: List[int]) -> None:
        """Count the given samples of this rank's share as processed."""
        self.record_batch(0, len(indices))

    @property
    def processed_num(self) -> int:
        """Samples of this epoch processed: in the whole world up to the last deal, plus this
        rank's since."""
        return self._start + self._done

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def __len__(self) -> int:
        """How many samples this rank's share of the rest of the epoch holds."""
        return len(self._indices)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "start": self._start, "done": self._done, "dealt_to": self._dealt_to,
                "seed": self.seed, "shuffle": self.shuffle, "length": len(self.dataset)}

    def load_state_dict(self, state: Dict[str, Any], redeal: bool = False) -> None:
        """Take ``state`` (from :meth:`state_dict`, on this rank or rank 0). With ``redeal`` the
        samples processed by every rank up to then are folded into the epoch's start and the rest
        is dealt to the current world, as after a reset."""
        if state.get("length") not in (None, len(self.dataset)) or state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"sampler state of a dataset of {state.get('length')} samples with seed {state.get('seed')} cannot "
                f"be loaded into a sampler of {len(self.dataset)} samples with seed {self.seed}; every rank must "
                "build its ElasticSampler over the same dataset with the same seed"
            )
        self.epoch = int(state["epoch"])
        self._start = int(state["start"])
        self._done = int(state["done"])
        dealt_to = int(state["dealt_to"])
        if redeal:
            remaining = len(self.dataset) - self._start
            self._start += min(remaining, self._done * dealt_to)
            self._done = 0
            self._deal()
        else:
            self._dealt_to = dealt_to
            from spark_hvd.torch.basics import is_initialized, rank

            r = rank() if is_initialized() else 0
            self._indices = self._order()[self._start:][r::max(1, dealt_to)]

    def sync_from(self, state: Optional[Dict[str, Any]]) -> None:
        """Become rank 0's sampler state (``state``) dealt anew to the current world."""
        if state is not None:
            self.load_state_dict(state, redeal=True)
