"""Elastic membership: how a worker learns its place in each world the launcher forms.

An elastic worker has an identity but no fixed rank. Every ``init()`` it announces itself at the
rendezvous (``elastic/join/<worker>`` = its join count) and waits for the launcher's answer
(``elastic/assign/<worker>/<count>``): the world's generation, its rank and size. The launcher forms
a world once every live worker has asked; survivors keep their order, so rank 0 is a survivor
whose state the others take. ``elastic/updates`` counts the changes of the available slots that
running workers should react to (new workers waiting to join).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Tuple

from .rendezvous import RendezvousClient

__all__ = ["Assignment", "join_key", "assign_key", "UPDATES_KEY", "join_next_world", "read_updates",
           "encode_updates"]

UPDATES_KEY = "elastic/updates"


def join_key(worker: str) -> str:
    return f"elastic/join/{worker}"


def assign_key(worker: str, count: int) -> str:
    return f"elastic/assign/{worker}/{count}"


@dataclass(frozen=True)
class Assignment:
    """A worker's place in one world."""

    generation: int
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    updates: int
    """The value of the updates counter when the world was formed."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Assignment":
        return cls(**{k: int(v) for k, v in json.loads(text).items()})


def encode_updates(version: int, added: bool) -> str:
    return json.dumps({"version": version, "added": added})


def join_next_world(cfg: Any, count: int) -> Assignment:
    """Announce worker ``cfg.worker_id`` for the ``count``-th time and wait for its assignment."""
    client = RendezvousClient(cfg.rendezvous_addr, cfg.secret, cfg.start_timeout)
    try:
        client.put(join_key(cfg.worker_id), str(count))
        (value,) = client.get([assign_key(cfg.worker_id, count)], timeout=cfg.elastic_timeout,
                              what="assignments from the elastic launcher (SPARK_HVD_ELASTIC_TIMEOUT)")
    finally:
        client.close()
    return Assignment.from_json(value)


def read_updates(client: RendezvousClient, timeout: float) -> Tuple[int, bool]:
    """The launcher's updates counter and whether the last update added slots."""
    (value,) = client.get([UPDATES_KEY], timeout=timeout, what="the elastic launcher's updates")
    data = json.loads(value)
    return int(data["version"]), bool(data["added"])
