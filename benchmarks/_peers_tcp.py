"""The floor of a two-rank allreduce over one TCP connection, in Python: each rank sends its buffer
while it receives the other's, then adds (``python _peers_tcp.py PLAN_JSON OUT_DIR``).

No framework does less for two ranks: one exchange of the whole buffer and one sum. It sets what the
link and the kernel allow a Python process here, so the frameworks' times read against it. The
launcher sets RANK, WORLD_SIZE (2), MASTER_ADDR and MASTER_PORT; rank 0 listens on MASTER_ADDR.
"""

from __future__ import annotations

import os
import select
import socket
import time
from typing import Any, Sequence

import numpy as np

from _peers_common import NumpyBuffers, measure, read_plan, write_rank_result

__all__ = ["main"]

_CONNECT_TIMEOUT_S = 60.0
_EXCHANGE_TIMEOUT_S = 120.0


def _connect(rank: int, address: str, port: int) -> socket.socket:
    if rank == 0:
        with socket.create_server((address, port), reuse_port=False) as server:
            server.settimeout(_CONNECT_TIMEOUT_S)
            sock, _ = server.accept()
    else:
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        while True:
            try:
                sock = socket.create_connection((address, port), timeout=5.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


class _TcpPair(NumpyBuffers):
    """Sum allreduce of numpy float32 buffers between the two ranks of one connection."""

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock = sock
        self.rank = rank
        self.size = 2
        self._incoming = bytearray(0)

    def _exchange(self, out: memoryview, into: memoryview) -> None:
        sent = got = 0
        n = len(out)
        deadline = time.monotonic() + _EXCHANGE_TIMEOUT_S
        while sent < n or got < n:
            try:
                if sent < n:
                    sent += self.sock.send(out[sent:])
            except BlockingIOError:
                pass
            try:
                while got < n:
                    count = self.sock.recv_into(into[got:], n - got)
                    if count == 0:
                        raise ConnectionError("the other rank closed the connection")
                    got += count
            except BlockingIOError:
                pass
            if sent < n or got < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"exchange of {n} bytes did not finish in {_EXCHANGE_TIMEOUT_S:.0f} s")
                select.select([self.sock] if got < n else [], [self.sock] if sent < n else [], [], 1.0)

    def allreduce(self, buf: np.ndarray) -> None:
        if len(self._incoming) < buf.nbytes:
            self._incoming = bytearray(buf.nbytes)
        into = memoryview(self._incoming)[:buf.nbytes]
        self._exchange(memoryview(buf).cast("B"), into)
        np.add(buf, np.frombuffer(into, dtype=np.float32), out=buf)

    def allreduce_many(self, bufs: Sequence[np.ndarray]) -> None:
        for buf in bufs:
            self.allreduce(buf)

    def barrier(self) -> None:
        self._exchange(memoryview(b"b"), memoryview(bytearray(1)))

    def max_scalar(self, value: float) -> float:
        theirs = bytearray(8)
        self._exchange(memoryview(np.array([value], dtype=np.float64).tobytes()), memoryview(theirs))
        return max(value, float(np.frombuffer(theirs, dtype=np.float64)[0]))


def main() -> None:
    import sys

    plan = read_plan(sys.argv[1:])
    rank = int(os.environ["RANK"])
    if int(os.environ["WORLD_SIZE"]) != 2:
        raise SystemExit("the TCP floor is a pair: WORLD_SIZE must be 2")
    sock = _connect(rank, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    try:
        result: Any = measure(_TcpPair(sock, rank), plan)
    finally:
        sock.close()
    result["rank"] = rank
    result["version"] = f"python {sys.version.split()[0]}"
    write_rank_result(sys.argv[2], rank, result)


if __name__ == "__main__":
    main()
