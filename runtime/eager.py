"""Small allreduces answered inside the negotiation messages, with no data phase of their own.

A worker sends a small allreduce's (prescaled) input along with its announcement; once every
contribution has arrived the coordinator reduces them itself and puts the results into the
response, so the request costs one round trip instead of a negotiation plus a ring.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .handles import Entry
from .messages import Meta, Response
from .ops import ReduceOp, average_inplace, reduce_into, scale_inplace, storage_dtype
from .timeline import REDUCE, Timeline
from .kinds import ALLREDUCE, ALLREDUCE_EAGER

__all__ = ["EagerAnswers"]


class EagerAnswers:
    """Payloads that came with announcements, and the answers computed from them (rank 0)."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        # (ps, name) -> rank -> its payload, or None when it announced the request without one
        self._payloads: Dict[Tuple[int, str], Dict[int, Optional[bytes]]] = {}

    def payloads(self, entries: Sequence[Entry]) -> List[Optional[bytes]]:
        """What a worker sends along with one announcement of ``entries``: the prescaled inputs of
        small allreduces, as long as their total stays within the threshold. A burst of many
        small requests goes on with the rest through the ring, fused, where the coordinator would
        otherwise reduce each of them in turn and every byte would cross the control links twice
        (the coordinator answers a fused request eagerly only when every part came along)."""
        budget = self.threshold
        out: List[Optional[bytes]] = []
        for entry in entries:
            meta = entry.meta
            payload = self.payload(entry) if meta.kind == ALLREDUCE and meta.nbytes() <= budget else None
            if payload is not None:
                budget -= len(payload)
            out.append(payload)
        return out

    def payload(self, entry: Entry) -> Optional[bytes]:
        """What a worker sends along with the announcement of ``entry``: its prescaled input, if small."""
        meta = entry.meta
        if meta.kind != ALLREDUCE or meta.device != "cpu" or entry.array is None or meta.nbytes() > self.threshold:
            return None
        if meta.prescale == 1.0:
            return entry.array.tobytes()
        data = entry.array.reshape(-1).copy()
        scale_inplace(data, meta.prescale, meta.dtype)
        return data.tobytes()

    def collect(self, meta: Meta, name: str, rank: int, payload: Optional[bytes]) -> None:
        """A worker announced request ``name``, with its payload or None. A small allreduce
        announced without one is remembered as such: that rank must not be taken for a joined
        one, which contributes zeros."""
        if meta.kind == ALLREDUCE and (payload is not None or meta.nbytes() <= self.threshold):
            self._payloads.setdefault((meta.ps, name), {})[rank] = payload

    def answer(self, responses: Tuple[Response, ...], resolve: Callable[[int], Meta],
               local: Mapping[Tuple[int, str], Entry], process_sets: Mapping[int, Tuple[int, ...]],
               joined: Sequence[int], timeline: Optional[Timeline], alone: bool = False) -> Tuple[Response, ...]:
        """``responses`` with every small allreduce whose contributions all came along answered
        (kind ``allreduce_eager``); the others stay regular allreduces. Rank 0's own contributions
        are in ``local``; joined ranks contribute zeros. ``alone``: a world of one, where every
        small allreduce is answered this way."""
        if not self._payloads and not alone:
            return responses
        out = []
        for response in responses:
            if response.kind != ALLREDUCE:
                out.append(response)
                continue
            first = resolve(response.sids[0])
            if first.device != "cpu" or first.nbytes() > self.threshold:
                out.append(response)  # fused responses hold only small or only large requests
                continue
            metas = [resolve(s) for s in response.sids]
            members = process_sets.get(response.ps, ())
            results = self._reduce(response.names, response.ps, metas, members, local,
                                   joined if response.ps == 0 else (), timeline)
            out.append(response if results is None else response._replace(kind=ALLREDUCE_EAGER, results=results))
        for response in responses:
            for name in response.names:
                self._payloads.pop((response.ps, name), None)
        return tuple(out)

    def _reduce(self, names: Sequence[str], ps: int, metas: Sequence[Meta], members: Sequence[int],
                local: Mapping[Tuple[int, str], Entry], joined: Sequence[int],
                timeline: Optional[Timeline]) -> Optional[Tuple[bytes, ...]]:
        start = time.perf_counter()
        results = []
        for name, meta in zip(names, metas):
            got = self._payloads.get((ps, name), {})
            dtype = storage_dtype(meta.dtype)
            op = ReduceOp(meta.op)
            acc: Optional[np.ndarray] = None
            for r in members:
                if r == 0:
                    mine = local.get((ps, name))
                    part = None
                    if mine is not None and mine.array is not None:
                        part = mine.array.reshape(-1)
                        if meta.prescale != 1.0:
                            part = part.copy()
                            scale_inplace(part, meta.prescale, meta.dtype)
                else:
                    payload = got.get(r)
                    if payload is None and r in got:
                        return None  # announced without its data: use the regular path
                    part = None if payload is None else np.frombuffer(payload, dtype=dtype)
                if part is None:
                    if r not in joined:
                        return None  # someone's data did not come along: use the regular path
                    part = np.zeros(meta.count(), dtype)  # a joined rank contributes zeros
                if acc is None:
                    acc = part.copy()
                else:
                    reduce_into(acc, part, op, meta.dtype)
            assert acc is not None
            if meta.op == ReduceOp.Average:
                average_inplace(acc, len(members), meta.dtype)
            scale_inplace(acc, meta.postscale, meta.dtype)
            results.append(acc.tobytes())
        if timeline is not None:
            now = time.perf_counter()
            for name in names:
                timeline.span(name, REDUCE, start * 1e6, now * 1e6, {"eager": True})
        return tuple(results)
