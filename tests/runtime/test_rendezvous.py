"""The rendezvous server: parked gets, deletes, and no stranger or bad frame can stop or bloat it."""

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from spark_hvd.runtime.config import new_secret
from spark_hvd.runtime.errors import RendezvousTimeout
from spark_hvd.runtime.rendezvous import REPLY_LIMIT, REQUEST_LIMIT, RendezvousClient, RendezvousServer
from spark_hvd.runtime.wire import authenticate_client, recv_frame, secret_bytes, send_frame
from harness import wait_until


@pytest.fixture
def served():
    secret = new_secret()
    server = RendezvousServer("127.0.0.1", secret)
    try:
        yield server, secret
    finally:
        server.close()


def _rss_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_gets_wait_for_keys_put_by_others(served):
    """Twenty clients each put one key and get all twenty: every get is answered, in key order,
    once the last key arrives."""
    server, secret = served
    keys = [f"g1/addr/{r}" for r in range(20)]
    results, errors = {}, []

    def rank(r):
        try:
            client = RendezvousClient(server.address, secret, 30.0)
            client.put(keys[r], f"value-{r}")
            results[r] = client.get(keys)
            client.close()
        except Exception as exc:  # reported below with the rank
            errors.append((r, exc))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert results == {r: [f"value-{i}" for i in range(20)] for r in range(20)}


def test_delete_removes_one_generation(served):
    """delete(prefix) removes exactly the keys under that prefix and says how many."""
    server, secret = served
    client = RendezvousClient(server.address, secret, 10.0)
    for key in ("g1/addr/0", "g1/addr/1", "g1/shm/0", "g2/addr/0", "g10/addr/0"):
        client.put(key, "x")
    assert client.delete("g1/") == 3
    assert sorted(server.values()) == ["g10/addr/0", "g2/addr/0"]
    with pytest.raises(RendezvousTimeout, match="g1/addr/0"):
        client.get(["g1/addr/0"], timeout=0.2)
    with pytest.raises(ValueError, match="non-empty key prefix"):
        client.delete("")
    client.close()


def test_close_answers_parked_gets(served):
    """A get still waiting when the server closes ends at once with RendezvousTimeout (naming the
    missing key when the request was parked, or the server's departure when it was not read)."""
    server, secret = served
    client = RendezvousClient(server.address, secret, 10.0)
    outcome = []

    def wait():
        try:
            client.get(["never"], timeout=120)
        except RendezvousTimeout as exc:
            outcome.append(str(exc))

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert wait_until(lambda: server.parked == 1, 10.0), "the get never reached the server"
    server.close()
    waiter.join(20)
    assert not waiter.is_alive()
    assert "never" in outcome[0] or "stopped answering" in outcome[0]
    client.close()


def test_idle_connections_cost_no_threads(served):
    """Three hundred idle connections add no thread to the server, and a client with the secret
    is still served while they wait."""
    server, secret = served
    before = threading.active_count()
    strangers = []
    try:
        for _ in range(300):
            strangers.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        assert wait_until(lambda: server.waiting + server.rejected == len(strangers), 20.0), server.waiting
        assert threading.active_count() <= before
        client = RendezvousClient(server.address, secret, 20.0)
        client.put("k", "v")
        assert client.get(["k"]) == ["v"]
        client.close()
    finally:
        for s in strangers:
            s.close()


def test_oversize_announcement_closes_the_connection_without_allocating(served):
    """An authenticated client announcing a 512 MiB request is cut off; the server's memory does
    not grow by the announced size, and it goes on serving others."""
    server, secret = served
    before = _rss_mib()
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    authenticate_client(raw, secret_bytes(secret), 10.0)
    raw.sendall((512 << 20).to_bytes(8, "big") + b"{" * 1000)
    try:
        closed = raw.recv(1) == b""
    except ConnectionResetError:
        closed = True
    raw.close()
    assert closed
    assert _rss_mib() - before < 64
    client = RendezvousClient(server.address, secret, 10.0)
    client.put("after", "ok")
    assert client.get(["after"]) == ["ok"]
    with pytest.raises(ValueError, match=f"larger than the {REQUEST_LIMIT} bytes"):
        client.put("huge", "x" * REQUEST_LIMIT)
    client.close()


FD_STARVED_SERVER = textwrap.dedent(
    """
    import logging, os, resource, sys
    from spark_hvd.runtime.rendezvous import RendezvousServer

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    server = RendezvousServer("127.0.0.1", sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Room for a few connections only, so accept() soon fails with EMFILE.
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 6, hard))
    print(server.address, flush=True)
    sys.stdin.read()
    server.close()
    """
)


def test_server_survives_running_out_of_file_descriptors():
    """When accept() fails with EMFILE the server logs it with the fix and keeps going: once the
    strangers are gone, a client with the secret is served."""
    secret = new_secret()
    proc = subprocess.Popen([sys.executable, "-c", FD_STARVED_SERVER, secret], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log_lines = []
    strangers = []
    try:
        address = proc.stdout.readline().strip()
        reader = threading.Thread(target=lambda: log_lines.extend(proc.stderr), daemon=True)
        reader.start()
        host, port = address.rsplit(":", 1)
        strangers = [socket.create_connection((host, int(port)), timeout=10) for _ in range(30)]
        deadline = time.monotonic() + 20
        while not any("out of file descriptors" in line for line in log_lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("out of file descriptors" in line and "ulimit -n" in line for line in log_lines), log_lines
        for s in strangers:
            s.close()
        client = RendezvousClient(address, secret, 30.0)
        client.put("k", "served")
        assert client.get(["k"]) == ["served"]
        client.close()
    finally:
        for s in strangers:
            s.close()
        proc.stdin.close()
        try:
            proc.wait(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_authenticated_connections_are_bounded():
    """Past max_connections, a client that authenticated is turned away with its connection closed,
    and those already connected are still served."""
    secret = new_secret()
    server = RendezvousServer("127.0.0.1", secret, max_connections=2)
    try:
        first, second = (RendezvousClient(server.address, secret, 10.0) for _ in range(2))
        extra = RendezvousClient(server.address, secret, 10.0)
        with pytest.raises(RendezvousTimeout, match="stopped answering"):
            extra.put("k", "refused")
        first.put("k", "v")
        assert second.get(["k"]) == ["v"]
        for client in (first, second, extra):
            client.close()
    finally:
        server.close()


def test_malformed_requests_get_an_error_and_the_server_goes_on(served):
    """Bad JSON, an unknown op and a request missing its fields each get an error reply naming the
    problem; the same connection is then served normally."""
    server, secret = served
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    authenticate_client(raw, secret_bytes(secret), 10.0)
    for request, problem in ((b"not json", "bad request"), (b'{"op": "rename"}', "unknown op 'rename'"),
                             (b'{"op": "get"}', "bad request: 'keys'")):
        send_frame(raw, request)
        assert problem in json.loads(recv_frame(raw, time.monotonic() + 10, REPLY_LIMIT))["error"]
    send_frame(raw, b'{"op": "put", "key": "k", "value": "v"}')
    assert json.loads(recv_frame(raw, time.monotonic() + 10, REPLY_LIMIT)) == {"ok": True}
    raw.close()
