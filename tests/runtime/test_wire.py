"""Authentication: only holders of the job secret get a frame read."""

import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from spark_hvd.runtime.config import new_secret
from spark_hvd.runtime.errors import AuthenticationError
from spark_hvd.runtime.rendezvous import RendezvousClient, RendezvousServer
from spark_hvd.runtime.wire import (HANDSHAKE_ATTEMPTS, FrameReader, authenticate_client, authenticate_server, listen,
                                    recv_frame, secret_bytes, send_frame)


def _serve_once(listener, key, outcome):
    conn, _ = listener.accept()
    with conn:
        try:
            authenticate_server(conn, key, 5.0)
            outcome.append(recv_frame(conn))
        except AuthenticationError as exc:
            outcome.append(exc)


@pytest.mark.parametrize("same_secret", [True, False])
def test_handshake_requires_the_secret(same_secret):
    """A client with the secret gets its frame read; one without is refused before any read."""
    key = secret_bytes(new_secret())
    listener = listen("127.0.0.1")
    outcome = []
    server = threading.Thread(target=_serve_once, args=(listener, key, outcome))
    server.start()
    client = socket.create_connection(listener.getsockname())
    client_key = key if same_secret else secret_bytes(new_secret())
    try:
        authenticate_client(client, client_key, 5.0)
        send_frame(client, b"payload")
    except (AuthenticationError, OSError):
        pass
    server.join(5)
    client.close()
    listener.close()
    if same_secret:
        assert outcome == [b"payload"]
    else:
        assert isinstance(outcome[0], AuthenticationError)


def test_listener_binds_only_the_given_address():
    """listen() binds the address it was given, not every interface."""
    sock = listen("127.0.0.1")
    assert sock.getsockname()[0] == "127.0.0.1"
    sock.close()


def test_rendezvous_put_get_and_timeout_names_missing_keys():
    """The rendezvous returns values once all keys exist and names missing ones on timeout."""
    secret = new_secret()
    server = RendezvousServer("127.0.0.1", secret)
    try:
        a = RendezvousClient(server.address, secret, 5.0)
        a.put("addr/0", "x")
        assert a.get(["addr/0"]) == ["x"]
        with pytest.raises(Exception, match=r"1 of 2 ranks did not arrive.*addr/1"):
            a.get(["addr/0", "addr/1"], timeout=0.3)
        with pytest.raises(AuthenticationError):
            RendezvousClient(server.address, new_secret(), 2.0)
        assert server.rejected == HANDSHAKE_ATTEMPTS  # the client tried again after each drop
        a.close()
    finally:
        server.close()


def test_secret_must_be_hex_and_long_enough():
    """A malformed secret is refused with a message saying how to make one."""
    with pytest.raises(ValueError, match="new_secret"):
        secret_bytes("not hex!")
    with pytest.raises(ValueError, match="at least 16"):
        secret_bytes("abcd")


# -- frame sizes ---------------------------------------------------------------------------------

def _header(length):
    return struct.pack("!Q", length)


def test_recv_frame_refuses_an_oversize_announcement_without_allocating():
    """A header announcing 1 GiB on a 1 MiB channel is a ConnectionError naming both sizes, raised
    at once instead of allocating the announced size and waiting for it."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(_header(1 << 30) + b"x" * 100)
        with pytest.raises(ConnectionError, match=r"1073741824 bytes.*1048576 bytes allowed"):
            recv_frame(ours, time.monotonic() + 5.0)


GROWTH_PROBE = textwrap.dedent(
    """
    import resource, socket, struct, sys, threading
    from spark_hvd.runtime.wire import recv_frame

    ours, theirs = socket.socketpair()
    def send():
        theirs.sendall(struct.pack("!Q", 200 << 20) + b"x" * 4096)
        theirs.close()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    threading.Thread(target=send).start()
    try:
        recv_frame(ours, limit=256 << 20)
    except ConnectionError as exc:
        print("closed:", exc, file=sys.stderr)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """
)


def test_recv_frame_memory_grows_with_the_bytes_received():
    """A 200 MiB frame (within its limit) of which 4 KiB arrive before the peer hangs up costs
    a few MiB at most, not the announced size (peak RSS of a fresh process)."""
    done = subprocess.run([sys.executable, "-c", GROWTH_PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "connection closed after 4096 of 209715200 bytes" in done.stderr
    assert int(done.stdout.strip()) < 32, f"peak RSS grew by {done.stdout.strip()} MiB"


def test_frame_reader_closes_a_stream_that_announces_too_much():
    """FrameReader marks a stream corrupt at the header of an oversize frame: closed, an error
    naming the sizes, and the connection shut down so the peer sees it end."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader = FrameReader(ours, limit=1 << 20, what="rank 3")
        theirs.sendall(_header(5) + b"hello" + _header(2 << 20))
        reader.pump()
        assert list(reader.frames) == [b"hello"]
        assert reader.closed
        assert "rank 3 announced a frame of 2097152 bytes" in reader.error
        theirs.settimeout(5.0)
        assert theirs.recv(1) == b""


def test_frame_reader_assembles_frames_that_arrive_in_pieces():
    """Frames split across many reads, and several in one read, come out whole and in order."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader = FrameReader(ours, limit=4 << 20)
        big = bytes(range(256)) * (3 * 4096)  # 3 MiB
        stream = _header(len(big)) + big + _header(0) + _header(3) + b"end"
        sender = threading.Thread(target=lambda: [theirs.sendall(stream[i:i + 70001])
                                                  for i in range(0, len(stream), 70001)])
        sender.start()
        deadline = time.monotonic() + 10
        while len(reader.frames) < 3 and time.monotonic() < deadline:
            select.select([ours], [], [], 0.1)
            reader.pump()
        sender.join(5)
        assert list(reader.frames) == [big, b"", b"end"]


def test_exact_frame_reader_leaves_the_next_frame_on_the_socket():
    """In exact mode the reader stops at the end of its frame, so the next owner of the socket
    reads the stream from the following byte."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(_header(5) + b"hello" + _header(4) + b"next")
        reader = FrameReader(ours, limit=64, exact=True)
        deadline = time.monotonic() + 5
        while not reader.frames and time.monotonic() < deadline:
            reader.pump()
        assert list(reader.frames) == [b"hello"]
        ours.settimeout(5.0)
        assert recv_frame(ours) == b"next"


def test_send_frame_refuses_what_the_receiver_would_not_accept():
    """send_frame with a limit raises ValueError naming the sizes instead of sending."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        with pytest.raises(ValueError, match="1025 bytes is larger than the 1024 bytes"):
            send_frame(ours, b"x" * 1025, limit=1024)
