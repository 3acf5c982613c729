"""A small authenticated key-value exchange through which ranks learn each other's addresses.

The launcher (``spark-hvd-run``, ``spark_hvd.runner.run``, the driver of a classic Spark session,
or rank 0's Spark task where the driver may be out of the executors' reach) serves it; workers
``put`` their own entry, ``get`` everyone's, and ``delete`` the keys of a generation they are done
with. Requests are JSON frames, read only after the connection has proved knowledge of the
job secret. The server is one thread around one selector: handshakes run concurrently through an
:class:`~.acceptor.Acceptor`, and a ``get`` whose keys are not all there yet is parked and answered
when the last one arrives or at its deadline, so idle or waiting clients cost no threads.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import selectors
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .acceptor import AUTH_TIMEOUT_S, Accepted, ServerLoop
from .errors import PeerUnreachableError, RendezvousTimeout
from .wire import FrameReader, connect, describe_broken, listen, recv_frame, secret_bytes, send_frame

__all__ = ["RendezvousServer", "RendezvousClient", "REQUEST_LIMIT", "REPLY_LIMIT"]

log = logging.getLogger("spark_hvd.rendezvous")

# A get of every rank's key in a 100,000-rank job is about 1.5 MiB of JSON.
REQUEST_LIMIT = 4 << 20
# Its answer carries every rank's address entry, about 150 bytes each.
REPLY_LIMIT = 64 << 20
# Authenticated clients held at once (each rank holds one during start-up); more are turned away
# with a log line naming the limit.
MAX_CONNECTIONS = 16384


class _Client:
    __slots__ = ("sock", "peer", "reader", "outbox", "parked", "writing")

    def __init__(self, accepted: Accepted) -> None:
        self.sock = accepted.sock
        self.peer = accepted.peer
        self.reader = FrameReader(accepted.sock, REQUEST_LIMIT, what=f"rendezvous client {accepted.peer}")
        self.outbox = bytearray()
        self.parked: Optional[_Get] = None
        self.writing = False


class _Get:
    __slots__ = ("client", "keys", "missing", "deadline", "done")

    def __init__(self, client: _Client, keys: List[str], missing: Set[str], deadline: float) -> None:
        self.client = client
        self.keys = keys
        self.missing = missing
        self.deadline = deadline
        self.done = False


class RendezvousServer(ServerLoop):
    """Serve the key-value exchange on ``host`` (an ephemeral port unless one is given).

    ``address`` is what clients dial: ``host``, or ``advertised_host`` where the address clients
    reach differs from the one listened on (a Spark driver's ``spark.driver.bindAddress`` and
    ``spark.driver.host``).
    """

    def __init__(self, host: str, secret: str, port: int = 0, auth_timeout: float = AUTH_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, advertised_host: Optional[str] = None) -> None:
        key = secret_bytes(secret)
        super().__init__(listen(host, port), key, what="rendezvous", thread_name="spark-hvd-rendezvous",
                         auth_timeout=auth_timeout)
        self.host = advertised_host or host
        self.port = self._listener.getsockname()[1]
        self._max_connections = max_connections
        self._values: Dict[str, str] = {}
        self._lock = threading.Lock()  # guards _values against values() from other threads
        self._clients: Dict[socket.socket, _Client] = {}
        self._waiters: Dict[str, Set[_Get]] = {}
        self._deadlines: List[Tuple[float, int, _Get]] = []
        self._parked: Set[_Get] = set()
        self._order = itertools.count()
        self._start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def parked(self) -> int:
        """Gets waiting for keys that are not there yet."""
        return len(self._parked)

    def values(self) -> Dict[str, str]:
        with self._lock:
            return dict(self._values)

    # -- the loop's hooks -------------------------------------------------------------------------
    def _next_deadline(self) -> Optional[float]:
        return self._deadlines[0][0] if self._deadlines else None

    def _tick(self, now: float) -> None:
        self._expire(now)

    def _on_handler_error(self, fileobj: object) -> None:
        client = self._clients.get(fileobj)  # type: ignore[call-overload]
        if client is not None:
            self._drop(client)

    def _on_accepted(self, accepted: Accepted) -> None:
        if len(self._clients) >= self._max_connections:
            log.warning("rendezvous: turned away %s: %d clients are connected already, the most this server "
                        "holds (RendezvousServer(max_connections=...))", accepted.peer, len(self._clients))
            accepted.sock.close()
            return
        client = _Client(accepted)
        self._clients[client.sock] = client
        self._selector.register(client.sock, selectors.EVENT_READ, self._on_client)

    def _on_client(self, sock: socket.socket, events: int) -> None:
        client = self._clients.get(sock)
        if client is None:
            return  # dropped earlier in this round of events
        if events & selectors.EVENT_WRITE:
            self._flush(client)
        if events & selectors.EVENT_READ and sock in self._clients:
            client.reader.pump()
            self._serve(client)

    def _serve(self, client: _Client) -> None:
        # One request at a time per client, in order: a parked get holds back whatever follows it.
        while client.reader.frames and client.parked is None and client.sock in self._clients:
            frame = client.reader.frames.popleft()
            try:
                reply = self._handle(client, json.loads(frame))
            except Exception as exc:  # a malformed request from an authenticated peer
                reply = {"error": f"bad request: {exc}"}
            if reply is not None:
                self._reply(client, reply)
        if client.reader.closed and client.sock in self._clients and not client.reader.frames:
            self._drop(client)

    def _handle(self, client: _Client, request: dict) -> Optional[dict]:
        op = request["op"]
        if op == "put":
            self._put(str(request["key"]), str(request["value"]))
            return {"ok": True}
        if op == "get":
            keys = [str(k) for k in request["keys"]]
            timeout = float(request["timeout"])
            with self._lock:
                missing = {k for k in keys if k not in self._values}
                if not missing:
                    return {"values": [self._values[k] for k in keys]}
            get = _Get(client, keys, missing, time.monotonic() + max(0.0, timeout))
            client.parked = get
            self._parked.add(get)
            for k in missing:
                self._waiters.setdefault(k, set()).add(get)
            heapq.heappush(self._deadlines, (get.deadline, next(self._order), get))
            return None
        if op == "delete":
            prefix = request["prefix"]
            if not isinstance(prefix, str) or not prefix:
                raise ValueError(f"delete needs a non-empty key prefix, got {prefix!r}")
            with self._lock:
                doomed = [k for k in self._values if k.startswith(prefix)]
                for k in doomed:
                    del self._values[k]
            return {"deleted": len(doomed)}
        raise ValueError(f"unknown op {op!r}; expected put, get or delete")

    def _put(self, key: str, value: str) -> None:
        with self._lock:
            self._values[key] = value
        for get in self._waiters.pop(key, ()):
            get.missing.discard(key)
            if not get.missing and not get.done:
                with self._lock:
                    values = [self._values[k] for k in get.keys]
                self._finish(get, {"values": values})

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, get = heapq.heappop(self._deadlines)
            if not get.done:
                self._finish(get, {"missing": [k for k in get.keys if k in get.missing]})
        # Answered gets stay in the heap until their deadline; a long job's many generations would
        # pile them up, so they are swept out once they are most of it.
        if len(self._deadlines) > 1024 and len(self._deadlines) > 2 * len(self._parked):
            self._deadlines = [entry for entry in self._deadlines if not entry[2].done]
            heapq.heapify(self._deadlines)

    def _finish(self, get: _Get, reply: dict) -> None:
        get.done = True
        self._parked.discard(get)
        for k in get.missing:
            waiting = self._waiters.get(k)
            if waiting is not None:
                waiting.discard(get)
                if not waiting:
                    del self._waiters[k]
        client = get.client
        if client.parked is get:
            client.parked = None
        if client.sock in self._clients:
            self._reply(client, reply)
            self._serve(client)  # requests that queued behind the parked one

    def _reply(self, client: _Client, reply: dict) -> None:
        payload = json.dumps(reply).encode()
        if len(payload) > REPLY_LIMIT:
            payload = json.dumps({"error": f"the answer has {len(payload)} bytes, more than the {REPLY_LIMIT} "
                                           "a client accepts; ask for fewer keys at once"}).encode()
        client.outbox += len(payload).to_bytes(8, "big") + payload
        self._flush(client)

    def _flush(self, client: _Client) -> None:
        while client.outbox:
            try:
                sent = client.sock.send(client.outbox)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._drop(client)
                return
            del client.outbox[:sent]
        want = bool(client.outbox)
        if want != client.writing:
            client.writing = want
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self._selector.modify(client.sock, events, self._on_client)

    def _drop(self, client: _Client) -> None:
        if self._clients.pop(client.sock, None) is None:
            return
        if client.parked is not None:
            client.parked.done = True
            self._parked.discard(client.parked)
            for k in client.parked.missing:
                waiting = self._waiters.get(k)
                if waiting is not None:
                    waiting.discard(client.parked)
                    if not waiting:
                        del self._waiters[k]
            client.parked = None
        try:
            self._selector.unregister(client.sock)
        except (KeyError, ValueError):
            pass
        client.sock.close()

    def _shut_down(self) -> None:
        # Waiting clients learn what is missing instead of waiting for their deadline.
        for get in list(self._parked):
            self._finish(get, {"missing": [k for k in get.keys if k in get.missing]})
        for client in list(self._clients.values()):
            self._drop(client)


class RendezvousClient:
    """Client of :class:`RendezvousServer`; one authenticated connection, requests in turn."""

    def __init__(self, addr: str, secret: str, timeout: float) -> None:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"rendezvous address {addr!r} is not host:port; SPARK_HVD_RENDEZVOUS_ADDR is set by the launcher"
            )
        self._timeout = timeout
        self._addr = addr
        self.address = addr
        """The server's ``host:port``."""
        self._sock = connect((host, int(port)), secret_bytes(secret), timeout, "the rendezvous server")

    def _call(self, request: dict, timeout: float) -> dict:
        payload = json.dumps(request).encode()
        try:
            send_frame(self._sock, payload, REQUEST_LIMIT)
            reply = json.loads(recv_frame(self._sock, time.monotonic() + timeout + 5.0, REPLY_LIMIT,
                                          "the rendezvous server"))
        except (OSError, ConnectionError) as exc:
            host = self._addr.rpartition(":")[0]
            raise PeerUnreachableError(
                f"the rendezvous server at {self._addr} stopped answering: "
                f"{describe_broken(exc, 'the rendezvous server') if isinstance(exc, OSError) else exc}",
                host=host) from None
        if "error" in reply:
            raise RuntimeError(f"rendezvous server: {reply['error']}")
        return reply

    def put(self, key: str, value: str) -> None:
        self._call({"op": "put", "key": key, "value": value}, self._timeout)

    def get(self, keys: Sequence[str], timeout: Optional[float] = None, what: str = "ranks") -> List[str]:
        """Values of ``keys``, waiting until all exist; RendezvousTimeout names the missing ones."""
        timeout = self._timeout if timeout is None else timeout
        reply = self._call({"op": "get", "keys": list(keys), "timeout": timeout}, timeout)
        if "missing" in reply:
            missing = reply["missing"]
            shown = ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else "")
            error = RendezvousTimeout(
                f"{len(missing)} of {len(keys)} {what} did not arrive at the rendezvous within {timeout:.0f} s "
                f"(missing: {shown}); check that every rank started, or raise SPARK_HVD_START_TIMEOUT"
            )
            error.missing = list(missing)  # type: ignore[attr-defined]
            raise error
        return reply["values"]

    def delete(self, prefix: str) -> int:
        """Remove every key that starts with ``prefix`` (e.g. ``"g3/"``); the number removed."""
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix={prefix!r} is invalid: expected a non-empty key prefix such as 'g3/'")
        return int(self._call({"op": "delete", "prefix": prefix}, self._timeout)["deleted"])

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
