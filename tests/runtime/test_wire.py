"""Authentication: only holders of the job secret get a frame read."""

import socket
import threading

import pytest

from spark_hvd.runtime.config import new_secret
from spark_hvd.runtime.errors import AuthenticationError
from spark_hvd.runtime.rendezvous import RendezvousClient, RendezvousServer
from spark_hvd.runtime.wire import (HANDSHAKE_ATTEMPTS, authenticate_client, authenticate_server, listen, recv_frame,
                                    secret_bytes, send_frame)


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
