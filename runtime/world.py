"""Start-up of one rank: rendezvous, authenticated connections, shared-memory rings.

Every rank listens on the address the worker contract gives it and publishes that address at the
rendezvous. Workers open a control connection to rank 0 (the coordinator). Data moves over
shared-memory rings between ranks of one host and over TCP between hosts; the higher rank of a
pair dials the lower. Every accepted connection authenticates before its first frame is read.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List

from .config import RuntimeConfig
from .acceptor import Acceptor
from .errors import RendezvousTimeout
from .rendezvous import RendezvousClient
from .shm import ShmChannel, ShmRing, job_token, ring_name, shm_available
from .transport import Channel, TcpChannel, Transport
from .wire import SMALL_FRAME_LIMIT, connect, listen, secret_bytes, send_frame, tune_socket

__all__ = ["World", "connect_world", "single_world"]

log = logging.getLogger("spark_hvd.world")

_SHM_SLOTS = 8


@dataclass
class World:
    """This rank's place in the job and its connections."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    transport: Transport
    control: Dict[int, socket.socket] = field(default_factory=dict)
    rejected: int = 0
    homogeneous: bool = True

    def close(self) -> None:
        for sock in self.control.values():
            try:
                sock.close()
            except OSError:
                pass
        self.transport.close()


def single_world() -> World:
    return World(0, 1, 0, 1, 0, 1, Transport(0, 1, {}))


def connect_world(cfg: RuntimeConfig) -> World:
    """Meet the other ranks and connect to them; RendezvousTimeout if they do not all arrive."""
    cfg = cfg.require_worker()
    assert cfg.rank is not None and cfg.size is not None and cfg.secret is not None
    rank, size = cfg.rank, cfg.size
    if size == 1:
        return single_world()
    key = secret_bytes(cfg.secret)
    deadline = time.monotonic() + cfg.start_timeout
    listener = listen(cfg.hostname, 0)
    # Rank 0 also takes control connections from its own host on a Unix socket (lower latency).
    unix_listener, unix_name = _unix_listener(cfg.secret) if rank == 0 else (None, None)
    rings: Dict[int, ShmRing] = {}
    client = RendezvousClient(cfg.rendezvous_addr, cfg.secret, cfg.start_timeout)  # type: ignore[arg-type]
    try:
        host_key = cfg.host_key or socket.gethostname()
        me = {"host": cfg.hostname, "port": listener.getsockname()[1], "host_key": host_key, "pid": os.getpid(),
              "unix": unix_name}
        client.put(f"addr/{rank}", json.dumps(me))
        peers = [json.loads(v) for v in client.get([f"addr/{r}" for r in range(size)],
                                                   timeout=_left(deadline), what="ranks")]
        use_shm = cfg.shm and shm_available()
        local = [r for r in range(size) if r != rank and use_shm and peers[r]["host_key"] == host_key]
        for peer in local:
            rings[peer] = ShmRing(ring_name(cfg.secret, rank, peer), _SHM_SLOTS, cfg.chunk_bytes, create=True)
        if local:
            client.put(f"shm/{rank}", "1")
            client.get([f"shm/{r}" for r in local], timeout=_left(deadline), what="local ranks")

        channels: Dict[int, Channel] = {}
        for peer in local:
            incoming = ShmRing(ring_name(cfg.secret, peer, rank), _SHM_SLOTS, cfg.chunk_bytes, create=False)
            channels[peer] = ShmChannel(peer, rings[peer], incoming, peers[peer]["pid"])

        control: Dict[int, socket.socket] = {}
        # Dial: workers dial rank 0 for control; the higher rank of a TCP pair dials the lower.
        dials = [(0, "control")] if rank != 0 else []
        dials += [(p, "data") for p in range(rank) if p not in local]
        for peer, purpose in dials:
            same_host = peers[peer]["host_key"] == host_key
            if purpose == "control" and same_host and peers[peer].get("unix"):
                address = "\0" + peers[peer]["unix"]
            else:
                address = (peers[peer]["host"], peers[peer]["port"])
            sock = connect(address, key, _left(deadline), f"rank {peer}")
            tune_socket(sock, cfg.peer_timeout)
            send_frame(sock, json.dumps({"rank": rank, "purpose": purpose}).encode())
            if purpose == "control":
                control[peer] = sock
            else:
                channels[peer] = TcpChannel(peer, sock, cfg.chunk_bytes)
        expected = {(p, "data") for p in range(rank + 1, size) if p not in local}
        if rank == 0:
            expected |= {(p, "control") for p in range(1, size)}
        listeners = [listener] + ([unix_listener] if unix_listener is not None else [])
        rejected = _accept(listeners, key, expected, control, channels, cfg, deadline)

        # Everyone has mapped its rings once rank 0 has heard from all: then the names can go.
        client.put(f"connected/{rank}", "1")
        client.get([f"connected/{r}" for r in range(size)], timeout=_left(deadline), what="ranks")
        for ring in rings.values():
            ring.unlink()
        per_host: Dict[str, int] = {}
        for peer in peers:
            per_host[peer["host_key"]] = per_host.get(peer["host_key"], 0) + 1
        return World(rank, size, cfg.local_rank, cfg.local_size, cfg.cross_rank, cfg.cross_size,  # type: ignore[arg-type]
                     Transport(rank, size, channels), control, rejected, len(set(per_host.values())) == 1)
    except BaseException:
        for ring in rings.values():
            ring.unlink()
        raise
    finally:
        client.close()
        listener.close()
        if unix_listener is not None:
            unix_listener.close()


def _left(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise RendezvousTimeout(
            "spark-hvd start-up did not finish within SPARK_HVD_START_TIMEOUT; check that every rank started"
        )
    return remaining


def _unix_listener(secret: str):
    """A listening socket in Linux's abstract namespace (nothing on disk to clean up), or none."""
    if not sys.platform.startswith("linux"):
        return None, None
    name = f"spark-hvd-{job_token(secret)}-control"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
    except OSError:
        sock.close()
        return None, None
    sock.listen(128)
    return sock, name


def _accept(listeners: List[socket.socket], key: bytes, expected: set, control: Dict[int, socket.socket],
            channels: Dict[int, Channel], cfg: RuntimeConfig, deadline: float) -> int:
    # Handshakes run concurrently with a short deadline each, so idle strangers on the listening
    # ports cannot hold up the ranks that are expected.
    acceptor = Acceptor(listeners, key, hello_limit=SMALL_FRAME_LIMIT, what=f"rank {cfg.rank}")
    refused = 0
    try:
        while expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(expected)
                raise RendezvousTimeout(
                    f"rank {cfg.rank}: connections from {missing} did not arrive within {cfg.start_timeout:.0f} s; "
                    "check that those ranks are running and can reach this host, or raise SPARK_HVD_START_TIMEOUT"
                )
            for accepted in acceptor.poll(min(remaining, 1.0)):
                sock = accepted.sock
                try:
                    hello = json.loads(accepted.hello or b"")
                    peer, purpose = int(hello["rank"]), str(hello["purpose"])
                except (ValueError, KeyError, TypeError) as exc:
                    refused += 1
                    log.warning("rank %s: %s sent a malformed hello (%s); closed", cfg.rank, accepted.peer, exc)
                    sock.close()
                    continue
                if (peer, purpose) not in expected:
                    refused += 1
                    log.warning("rank %s: unexpected %s connection from rank %s; closed", cfg.rank, purpose, peer)
                    sock.close()
                    continue
                expected.discard((peer, purpose))
                sock.settimeout(None)
                tune_socket(sock, cfg.peer_timeout)
                if purpose == "control":
                    control[peer] = sock
                else:
                    channels[peer] = TcpChannel(peer, sock, cfg.chunk_bytes)
    finally:
        acceptor.close()
    return acceptor.rejected + refused
