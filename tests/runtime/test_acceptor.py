"""The acceptor: concurrent handshakes, bounded and timed-out strangers, exact hellos."""

import json
import socket
import threading
import time

import pytest

from spark_hvd.runtime.acceptor import Acceptor
from spark_hvd.runtime.config import new_secret
from spark_hvd.runtime.errors import AuthenticationError
from spark_hvd.runtime.wire import HANDSHAKE_ATTEMPTS, connect, listen, recv_frame, secret_bytes, send_frame
from harness import wait_until


class Driver:
    """Runs an acceptor's poll loop on a thread and collects what it hands over."""

    def __init__(self, acceptor):
        self.acceptor = acceptor
        self.accepted = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            self.accepted.extend(self.acceptor.poll(0.05))

    def wait_for(self, count, timeout=10.0):
        deadline = time.monotonic() + timeout
        while len(self.accepted) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.accepted[:count]

    def stop(self):
        self._stop = True
        self._thread.join(5)
        self.acceptor.close()
        for accepted in self.accepted:
            accepted.sock.close()


def _stranger(port):
    """An idle connection that has been accepted (it holds the server's challenge)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    assert len(sock.recv(32)) == 32
    return sock


def _closed_by_server(sock, timeout):
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@pytest.fixture
def secret():
    return new_secret()


def test_idle_strangers_do_not_delay_a_peer(secret):
    """With 40 idle strangers in the middle of their handshake (and a timeout long enough that
    none is dropped), a client with the secret is authenticated at once."""
    listener = listen("127.0.0.1")
    driver = Driver(Acceptor([listener], secret_bytes(secret), auth_timeout=60.0))
    strangers = []
    try:
        strangers = [_stranger(listener.getsockname()[1]) for _ in range(40)]
        sock = connect(listener.getsockname(), secret_bytes(secret), 10.0, "the test acceptor")
        sock.close()
        assert len(driver.wait_for(1)) == 1
        assert driver.acceptor.rejected == 0
    finally:
        for s in strangers:
            s.close()
        driver.stop()
        listener.close()


def test_oldest_stranger_is_dropped_when_too_many_wait(secret):
    """Past max_pending unauthenticated connections, the oldest are closed first; the newest stay."""
    listener = listen("127.0.0.1")
    driver = Driver(Acceptor([listener], secret_bytes(secret), auth_timeout=60.0, max_pending=5))
    strangers = []
    try:
        strangers = [_stranger(listener.getsockname()[1]) for _ in range(8)]
        assert [_closed_by_server(s, 5.0) for s in strangers[:3]] == [True] * 3
        assert [_closed_by_server(s, 0.2) for s in strangers[3:]] == [False] * 5
        assert wait_until(lambda: driver.acceptor.rejected == 3, 5.0)
    finally:
        for s in strangers:
            s.close()
        driver.stop()
        listener.close()


def test_strangers_are_closed_at_their_deadline(secret):
    """An idle connection and one that sends garbage are both closed, the idle one once its
    short authentication deadline has passed."""
    listener = listen("127.0.0.1")
    driver = Driver(Acceptor([listener], secret_bytes(secret), auth_timeout=0.5))
    try:
        idle = _stranger(listener.getsockname()[1])
        garbage = _stranger(listener.getsockname()[1])
        garbage.sendall(b"\x80\x05 not a proof " * 8)
        assert _closed_by_server(garbage, 10.0)
        assert _closed_by_server(idle, 10.0)
        assert wait_until(lambda: driver.acceptor.rejected == 2, 5.0)
        idle.close()
        garbage.close()
    finally:
        driver.stop()
        listener.close()


def test_wrong_secret_is_refused_after_a_bounded_number_of_attempts(secret):
    """A client with another secret gets AuthenticationError naming the secret setting, after
    HANDSHAKE_ATTEMPTS handshakes, each refused by the server."""
    listener = listen("127.0.0.1")
    driver = Driver(Acceptor([listener], secret_bytes(secret)))
    try:
        with pytest.raises(AuthenticationError, match="SPARK_HVD_SECRET"):
            connect(listener.getsockname(), secret_bytes(new_secret()), 10.0, "the test acceptor")
        assert driver.acceptor.rejected == HANDSHAKE_ATTEMPTS
        assert driver.accepted == []
    finally:
        driver.stop()
        listener.close()


def test_hello_is_handed_over_exactly(secret):
    """With a hello limit, the first frame comes with the connection and the bytes after it stay
    on the socket for the new owner; a hello over the limit gets the connection closed."""
    listener = listen("127.0.0.1")
    driver = Driver(Acceptor([listener], secret_bytes(secret), hello_limit=1024))
    try:
        good = connect(listener.getsockname(), secret_bytes(secret), 10.0, "the test acceptor")
        send_frame(good, json.dumps({"rank": 1}).encode())
        send_frame(good, b"engine traffic")
        (accepted,) = driver.wait_for(1)
        assert json.loads(accepted.hello) == {"rank": 1}
        accepted.sock.settimeout(5.0)
        assert recv_frame(accepted.sock) == b"engine traffic"

        big = connect(listener.getsockname(), secret_bytes(secret), 10.0, "the test acceptor")
        big.sendall((1 << 30).to_bytes(8, "big"))
        assert _closed_by_server(big, 10.0)
        assert wait_until(lambda: driver.acceptor.rejected == 1, 5.0)
        good.close()
        big.close()
    finally:
        driver.stop()
        listener.close()


def test_connections_on_several_listeners_are_accepted(secret):
    """TCP and unix listeners are served by one acceptor."""
    tcp = listen("127.0.0.1")
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0spark-hvd-test-{new_secret()[:16]}"
    unix.bind(name)
    unix.listen(16)
    driver = Driver(Acceptor([tcp, unix], secret_bytes(secret)))
    try:
        a = connect(tcp.getsockname(), secret_bytes(secret), 10.0, "tcp")
        b = connect(name, secret_bytes(secret), 10.0, "unix")
        assert len(driver.wait_for(2)) == 2
        a.close()
        b.close()
    finally:
        driver.stop()
        tcp.close()
        unix.close()
