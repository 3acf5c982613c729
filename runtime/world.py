"""Start-up of one rank: rendezvous, authenticated connections, shared-memory rings.

Every rank listens on the address the worker contract gives it and publishes that address at the
rendezvous. Workers open a control connection to rank 0 (the coordinator). Data moves over
shared-memory rings between ranks of one host and over TCP between hosts; the higher rank of a
pair dials the lower. Every accepted connection authenticates before its first frame is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from .config import RuntimeConfig
from .acceptor import Acceptor
from .control import ControlLink, SocketLink
from .errors import CollectiveError, PeerUnreachableError, RendezvousTimeout, SparkHvdError
from .net import advertised_address
from .rendezvous import RendezvousClient
from .lockstep import MAILBOX_HEADER, SLOTS as MAILBOX_SLOTS, mailbox_tag
from .shm import ShmChannel, ShmRing, ring_tag, shm_available
from .transport import Channel, TcpChannel, Transport
from .wire import SMALL_FRAME_LIMIT, connect, describe_broken, is_network_error, listen, secret_bytes, send_frame, \
    tune_socket

__all__ = ["World", "PeerLink", "connect_world", "single_world"]

log = logging.getLogger("spark_hvd.world")

_SHM_SLOTS = 8
_ORDER_MAX_RANKS = 16
"""The largest world across hosts that gets program-order links (one socket per pair of ranks)."""


@dataclass(frozen=True)
class PeerLink:
    """How this rank's data reaches one other rank."""

    rank: int
    """The other rank."""
    transport: str
    """``"shm"`` (shared memory on this host), ``"tcp"``, or the data plane's own (``"mpi"``)."""
    host: str
    """The other rank's host (its host key: the hostname unless SPARK_HVD_HOST_KEY says otherwise)."""
    address: Optional[str] = None
    """``ip:port`` of the other end of a TCP link."""
    local_address: Optional[str] = None
    """``ip:port`` of this end of a TCP link."""


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
    control: Dict[int, ControlLink] = field(default_factory=dict)
    rejected: int = 0
    homogeneous: bool = True
    hosts: List[str] = field(default_factory=list)
    """Each rank's host key, in rank order (which ranks share shared memory)."""
    data: Optional[Any] = None
    """A data plane of the world's own (the MPI backend); None: the built-in rings over ``transport``."""
    on_close: Optional[Callable[[], None]] = None
    """What else ending the world takes (freeing MPI communicators)."""
    mailboxes: Optional[List[ShmRing]] = None
    """Every rank's shared-memory mailbox, in rank order, when all ranks share this host (see
    :mod:`~spark_hvd.runtime.lockstep`); None otherwise."""
    order_links: Optional[Dict[int, socket.socket]] = None
    """A TCP connection to every other rank for the program-order path of a world across hosts (see
    :class:`~spark_hvd.runtime.lockstep.LinkLockstep`); None otherwise."""
    peer_names: List[str] = field(default_factory=list)
    """Each rank as messages name it (``rank 1 on host h2 (10.0.0.2)``), in rank order."""

    def links(self) -> List[PeerLink]:
        """How data reaches every other rank, in rank order."""
        found = []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            host = self.hosts[peer] if peer < len(self.hosts) else ""
            channel = self.transport.channels.get(peer)
            if self.data is not None or channel is None:
                found.append(PeerLink(peer, "mpi" if self.data is not None else "none", host))
                continue
            sock = getattr(channel, "sock", None)
            found.append(PeerLink(peer, getattr(channel, "kind", type(channel).__name__), host,
                                  address=_endpoint(sock, remote=True), local_address=_endpoint(sock, remote=False)))
        return found

    def close(self) -> None:
        for link in self.control.values():
            link.close()
        self.transport.close()
        for box in self.mailboxes or ():
            box.close()
        for sock in (self.order_links or {}).values():
            sock.close()
        if self.on_close is not None:
            self.on_close()


def single_world() -> World:
    return World(0, 1, 0, 1, 0, 1, Transport(0, 1, {}))


def _endpoint(sock: Optional[socket.socket], remote: bool) -> Optional[str]:
    if sock is None:
        return None
    try:
        name = sock.getpeername() if remote else sock.getsockname()
    except OSError:
        return None
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else None


def _where(peer: int, entry: Dict[str, Any]) -> str:
    """A peer as messages name it: ``rank 1 on host h2 (10.0.0.2)``."""
    host, key = entry.get("host"), entry.get("host_key")
    return f"rank {peer} on host {key} ({host})" if key and key != host else f"rank {peer} on host {host}"


def _local_identity() -> Dict[str, object]:
    """What ranks compare to know that they can map each other's memory files through /proc."""
    try:
        ns = os.stat("/proc/self/ns/pid")
        pidns = f"{ns.st_dev}:{ns.st_ino}"
    except OSError:
        pidns = None
    return {"pid": os.getpid(), "pidns": pidns, "uid": os.getuid() if hasattr(os, "getuid") else None}


def _same_machine_view(me: dict, peer: dict) -> bool:
    return (peer["host_key"] == me["host_key"] and peer.get("pidns") is not None
            and peer.get("pidns") == me.get("pidns") and peer.get("uid") == me.get("uid"))


def connect_world(cfg: RuntimeConfig, generation: int = 1) -> World:
    """Meet the other ranks and connect to them; RendezvousTimeout if they do not all arrive.

    ``generation`` counts this process's init() calls: every rendezvous key and ring of one
    world carries it, so a world formed after shutdown() never meets the previous one's leftovers.
    The phases: announce this rank's addresses and learn everyone's, map shared memory with the
    ranks of this host, dial and accept the TCP and control connections, and wait until every rank
    is connected.
    """
    cfg = cfg.require_worker()
    assert cfg.rank is not None and cfg.size is not None and cfg.secret is not None
    rank, size = cfg.rank, cfg.size
    if size == 1:
        return single_world()
    key = secret_bytes(cfg.secret)
    gen = f"g{generation}/"
    deadline = time.monotonic() + cfg.start_timeout
    address = advertised_address(cfg.hostname, cfg.iface)
    listener = listen(address, 0)
    # Rank 0 also takes control connections from its own host on a Unix socket (lower latency).
    unix_listener, unix_name = _unix_listener(cfg.secret, generation) if rank == 0 else (None, None)
    rings: Dict[int, ShmRing] = {}
    boxes: Dict[int, ShmRing] = {}
    channels: Dict[int, Channel] = {}
    control: Dict[int, socket.socket] = {}
    orders: Dict[int, socket.socket] = {}
    client = RendezvousClient(cfg.rendezvous_addr, cfg.secret, cfg.start_timeout)  # type: ignore[arg-type]
    try:
        host_key = cfg.host_key or socket.gethostname()
        me = {"host": address, "port": listener.getsockname()[1], "host_key": host_key, "unix": unix_name,
              "order": cfg.lockstep_bytes > 0 and cfg.lockstep_link_bytes > 0, **_local_identity()}
        peers = _announce(client, gen, generation, rank, size, me, deadline)
        local = _map_shared_memory(client, cfg, gen, key, generation, me, peers, rings, boxes, channels,
                                   deadline)
        # Every rank sees the same announcements, so all of them make these links or none does.
        order = (size <= _ORDER_MAX_RANKS and len({p["host_key"] for p in peers}) > 1
                 and all(p.get("order") for p in peers))
        _dial(cfg, key, peers, local, host_key, control, channels, deadline, orders if order else None)
        expected = {(p, "data") for p in range(rank + 1, size) if p not in local}
        if order:
            expected |= {(p, "order") for p in range(rank + 1, size)}
        if rank == 0:
            expected |= {(p, "control") for p in range(1, size)}
        listeners = [listener] + ([unix_listener] if unix_listener is not None else [])
        rejected = _accept(listeners, key, expected, control, channels, cfg, peers, deadline, orders)
        _meet_connected(client, gen, rank, size, [*rings.values(), *boxes.values()], deadline)
        per_host: Dict[str, int] = {}
        for peer in peers:
            per_host[peer["host_key"]] = per_host.get(peer["host_key"], 0) + 1
        links = {peer: SocketLink(sock, what=_where(peer, peers[peer])) for peer, sock in control.items()}
        world = World(rank, size, cfg.local_rank, cfg.local_size, cfg.cross_rank, cfg.cross_size,  # type: ignore[arg-type]
                      Transport(rank, size, channels), links, rejected, len(set(per_host.values())) == 1,
                      hosts=[peer["host_key"] for peer in peers],
                      mailboxes=[boxes[r] for r in range(size)] if len(boxes) == size else None,
                      order_links=dict(orders) if order else None,
                      peer_names=[_where(p, peers[p]) for p in range(size)])
        if log.isEnabledFor(logging.INFO):
            log.info("rank %d on %s (%s): %s", rank, host_key, address, ", ".join(
                f"rank {p.rank} {p.transport}" + (f" {p.address}" if p.address else "") for p in world.links()))
        return world
    except OSError as exc:
        _close_all([*control.values(), *orders.values()], channels, [*rings.values(), *boxes.values()])
        if isinstance(exc, SparkHvdError) or not is_network_error(exc):
            raise
        # Whatever start-up step it broke, a network error is the host's or the path's, not the job's.
        raise PeerUnreachableError(f"rank {rank} on host {cfg.host_key or socket.gethostname()} ({address}) lost a "
                                   f"connection during start-up: {describe_broken(exc, 'a peer')}") from None
    except BaseException:
        _close_all([*control.values(), *orders.values()], channels, [*rings.values(), *boxes.values()])
        raise
    finally:
        client.close()
        listener.close()
        if unix_listener is not None:
            unix_listener.close()


def _close_all(sockets: List[socket.socket], channels: Dict[int, Channel], rings: List[ShmRing]) -> None:
    for sock in sockets:
        sock.close()
    for channel in channels.values():
        channel.close()
    for ring in rings:
        ring.close()


def _announce(client: RendezvousClient, gen: str, generation: int, rank: int, size: int, me: Dict[str, Any],
              deadline: float) -> List[Dict[str, Any]]:
    """Publish this rank's addresses at the rendezvous; every rank's, in rank order."""
    if rank == 0 and generation > 2:
        # Every rank is past generation - 2 once anyone has reached this one; its keys can go.
        client.delete(f"g{generation - 2}/")
    client.put(f"{gen}addr/{rank}", json.dumps(me))
    return [json.loads(v) for v in _get_ranks(client, gen, "addr", range(size), deadline)]


def _get_ranks(client: RendezvousClient, gen: str, kind: str, ranks: Any, deadline: float) -> List[str]:
    """Every one of ``ranks``' ``kind`` entries, waiting until they are there; a RendezvousTimeout that
    names the ranks that never put theirs."""
    keys = [f"{gen}{kind}/{r}" for r in ranks]
    try:
        return client.get(keys, timeout=_left(deadline), what="ranks")
    except RendezvousTimeout as exc:
        missing = getattr(exc, "missing", None)
        if not missing:
            raise
        late = [key.rsplit("/", 1)[1] for key in missing]
        one = len(late) == 1
        who = f"rank {late[0]}" if one else "ranks " + ", ".join(late[:10]) + (" ..." if len(late) > 10 else "")
        its = "its" if one else "their"
        raise RendezvousTimeout(
            f"{who} did not reach the rendezvous at {client.address} within SPARK_HVD_START_TIMEOUT: {its} "
            f"process did not start or stalled, or the network path from {its} host to this address is down (a cut "
            f"link, a firewall); see {its} own error, or raise SPARK_HVD_START_TIMEOUT") from None


def _map_shared_memory(client: RendezvousClient, cfg: RuntimeConfig, gen: str, key: bytes, generation: int,
                       me: Dict[str, Any], peers: List[Dict[str, Any]], rings: Dict[int, ShmRing],
                       boxes: Dict[int, ShmRing], channels: Dict[int, Channel], deadline: float) -> List[int]:
    """Rings with every rank of this host that can map this process's memory; those ranks. When
    that is every other rank, also every rank's mailbox (``boxes``, this rank's own included)."""
    rank, size = cfg.rank, cfg.size
    assert rank is not None and size is not None
    use_shm = cfg.shm and shm_available(cfg.shm_ordering)
    local = [r for r in range(size) if r != rank and use_shm and _same_machine_view(me, peers[r])]
    for peer in local:
        rings[peer] = ShmRing.create(_SHM_SLOTS, cfg.chunk_bytes, ring_tag(key, generation, rank, peer),
                                     cfg.shm_ordering)
    box_bytes = _mailbox_bytes(cfg.lockstep_bytes)
    if local and box_bytes and len(local) == size - 1:
        boxes[rank] = ShmRing.create(MAILBOX_SLOTS, box_bytes, mailbox_tag(key, generation, rank), cfg.shm_ordering)
    if local:
        mine = {str(p): ring.fd for p, ring in rings.items()}
        if rank in boxes:
            mine["box"] = boxes[rank].fd
        client.put(f"{gen}shm/{rank}", json.dumps(mine))
        fds = [json.loads(v) for v in _get_ranks(client, gen, "shm", local, deadline)]
        for peer, theirs in zip(local, fds):
            incoming = _open_shared(peers[peer]["pid"], theirs[str(rank)], cfg, _SHM_SLOTS, cfg.chunk_bytes,
                                    ring_tag(key, generation, peer, rank))
            channels[peer] = ShmChannel(peer, rings[peer], incoming, peers[peer]["pid"])
        if rank in boxes and all("box" in theirs for theirs in fds):
            for peer, theirs in zip(local, fds):
                boxes[peer] = _open_shared(peers[peer]["pid"], theirs["box"], cfg, MAILBOX_SLOTS, box_bytes,
                                           mailbox_tag(key, generation, peer))
        elif rank in boxes:
            boxes.pop(rank).close()  # a rank without one (SPARK_HVD_LOCKSTEP_BYTES=0 there): nobody uses them
    return local


def _mailbox_bytes(lockstep_bytes: int) -> int:
    """A mailbox slot's size: the header and ``lockstep_bytes`` of data, in whole cache lines."""
    if lockstep_bytes <= 0:
        return 0
    return MAILBOX_HEADER + -(-lockstep_bytes // 64) * 64


def _dial(cfg: RuntimeConfig, key: bytes, peers: List[Dict[str, Any]], local: List[int], host_key: str,
          control: Dict[int, socket.socket], channels: Dict[int, Channel], deadline: float,
          orders: Optional[Dict[int, socket.socket]] = None) -> None:
    """Workers dial rank 0 for control; the higher rank of a TCP pair dials the lower (data, and
    the program-order links when ``orders`` is given)."""
    rank = cfg.rank
    assert rank is not None
    dials = [(0, "control")] if rank != 0 else []
    dials += [(p, "data") for p in range(rank) if p not in local]
    if orders is not None:
        dials += [(p, "order") for p in range(rank)]
    for peer, purpose in dials:
        same_host = peers[peer]["host_key"] == host_key
        if purpose == "control" and same_host and peers[peer].get("unix"):
            address: Any = "\0" + peers[peer]["unix"]
        else:
            address = (peers[peer]["host"], peers[peer]["port"])
        where = _where(peer, peers[peer])
        sock = connect(address, key, _left(deadline), where)
        try:
            tune_socket(sock, cfg.peer_timeout)
            send_frame(sock, json.dumps({"rank": rank, "purpose": purpose}).encode())
        except OSError as exc:
            sock.close()
            raise PeerUnreachableError(f"rank {rank} lost its new connection to {where} during start-up: "
                                       f"{describe_broken(exc, where)}", host=peers[peer]["host"]) from None
        if purpose == "control":
            control[peer] = sock
        elif purpose == "order":
            orders[peer] = sock  # type: ignore[index]
        else:
            channels[peer] = TcpChannel(peer, sock, cfg.chunk_bytes, where)


def _meet_connected(client: RendezvousClient, gen: str, rank: int, size: int, rings: List[ShmRing],
                    deadline: float) -> None:
    """Wait until every rank has connected: then every ring has been mapped by its reader, and
    nobody needs to reach the memory files any more."""
    client.put(f"{gen}connected/{rank}", "1")
    _get_ranks(client, gen, "connected", range(size), deadline)
    for ring in rings:
        ring.release_fd()


def _open_shared(pid: int, fd: int, cfg: RuntimeConfig, slots: int, slot_bytes: int, tag: bytes) -> ShmRing:
    try:
        return ShmRing.open_peer(pid, fd, slots, slot_bytes, tag, cfg.shm_ordering)
    except OSError as exc:
        raise CollectiveError(
            f"rank {cfg.rank} could not map the shared memory of the process {pid} on its host ({exc}); "
            "set SPARK_HVD_SHM=0 to move data between the ranks of one host over sockets instead"
        ) from None


def _left(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise RendezvousTimeout(
            "spark-hvd start-up did not finish within SPARK_HVD_START_TIMEOUT; check that every rank started"
        )
    return remaining


def _unix_listener(secret: str, generation: int):
    """A listening socket in Linux's abstract namespace (nothing on disk to clean up), or none."""
    if not sys.platform.startswith("linux"):
        return None, None
    token = hashlib.sha256(("spark-hvd-control" + secret).encode()).hexdigest()[:16]
    name = f"spark-hvd-{token}-g{generation}-control"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
    except OSError:
        sock.close()
        return None, None
    sock.listen(128)
    return sock, name


def _accept(listeners: List[socket.socket], key: bytes, expected: set, control: Dict[int, socket.socket],
            channels: Dict[int, Channel], cfg: RuntimeConfig, peers: List[Dict[str, Any]], deadline: float,
            orders: Dict[int, socket.socket]) -> int:
    # Handshakes run concurrently with a short deadline each, so idle strangers on the listening
    # ports cannot hold up the ranks that are expected.
    acceptor = Acceptor(listeners, key, hello_limit=SMALL_FRAME_LIMIT, what=f"rank {cfg.rank}")
    refused = 0
    try:
        while expected:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = ", ".join(f"{_where(p, peers[p])} ({purpose})" for p, purpose in sorted(expected))
                raise PeerUnreachableError(
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
                elif purpose == "order":
                    orders[peer] = sock
                else:
                    channels[peer] = TcpChannel(peer, sock, cfg.chunk_bytes, _where(peer, peers[peer]))
    finally:
        acceptor.close()
    return acceptor.rejected + refused
