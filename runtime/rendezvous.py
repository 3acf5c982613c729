"""A small authenticated key-value exchange through which ranks learn each other's addresses.

The launcher (``spark-hvd-run``, ``spark_hvd.runner.run`` or rank 0's Spark task) serves it;
workers ``put`` their own entry and ``get`` everyone's. Requests are JSON frames, read only after
the connection has proved knowledge of the job secret.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence

from .errors import AuthenticationError, RendezvousTimeout
from .wire import authenticate_server, connect, listen, recv_frame, secret_bytes, send_frame

__all__ = ["RendezvousServer", "RendezvousClient"]

log = logging.getLogger("spark_hvd.rendezvous")


class RendezvousServer:
    """Serve the key-value exchange on ``host`` (an ephemeral port unless one is given)."""

    def __init__(self, host: str, secret: str, port: int = 0, auth_timeout: float = 10.0) -> None:
        self._key = secret_bytes(secret)
        self._sock = listen(host, port)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._auth_timeout = auth_timeout
        self._values: Dict[str, str] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._threads: List[threading.Thread] = []
        self.rejected = 0
        self._acceptor = threading.Thread(target=self._accept_loop, name="spark-hvd-rendezvous", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                authenticate_server(conn, self._key, self._auth_timeout)
            except AuthenticationError as exc:
                self.rejected += 1
                log.warning("rendezvous: rejected a connection: %s", exc)
                return
            conn.settimeout(None)
            while not self._closed:
                try:
                    request = json.loads(recv_frame(conn))
                except (ConnectionError, OSError, ValueError):
                    return
                try:
                    reply = self._handle(request)
                except Exception as exc:  # a malformed request from an authenticated peer
                    reply = {"error": f"bad request: {exc}"}
                try:
                    send_frame(conn, json.dumps(reply).encode())
                except OSError:
                    return

    def _handle(self, request: dict) -> dict:
        op = request["op"]
        if op == "put":
            with self._cond:
                self._values[str(request["key"])] = str(request["value"])
                self._cond.notify_all()
            return {"ok": True}
        if op == "get":
            keys = [str(k) for k in request["keys"]]
            deadline = time.monotonic() + float(request["timeout"])
            with self._cond:
                while True:
                    missing = [k for k in keys if k not in self._values]
                    if not missing:
                        return {"values": [self._values[k] for k in keys]}
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._closed:
                        return {"missing": missing}
                    self._cond.wait(min(remaining, 1.0))
        raise ValueError(f"unknown op {op!r}")

    def values(self) -> Dict[str, str]:
        with self._cond:
            return dict(self._values)

    def close(self) -> None:
        self._closed = True
        with self._cond:
            self._cond.notify_all()
        try:
            self._sock.close()
        except OSError:
            pass


class RendezvousClient:
    """Client of :class:`RendezvousServer`; one authenticated connection, requests in turn."""

    def __init__(self, addr: str, secret: str, timeout: float) -> None:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"rendezvous address {addr!r} is not host:port; SPARK_HVD_RENDEZVOUS_ADDR is set by the launcher"
            )
        self._timeout = timeout
        self._sock = connect((host, int(port)), secret_bytes(secret), timeout, "the rendezvous server")

    def _call(self, request: dict, timeout: float) -> dict:
        send_frame(self._sock, json.dumps(request).encode())
        try:
            reply = json.loads(recv_frame(self._sock, time.monotonic() + timeout + 5.0))
        except (OSError, ConnectionError) as exc:
            raise RendezvousTimeout(f"the rendezvous server stopped answering: {exc}") from None
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
            raise RendezvousTimeout(
                f"{len(missing)} of {len(keys)} {what} did not arrive at the rendezvous within {timeout:.0f} s "
                f"(missing: {shown}); check that every rank started, or raise SPARK_HVD_START_TIMEOUT"
            )
        return reply["values"]

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
