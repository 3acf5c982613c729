"""Idle and garbage connections to rank 0's listening sockets during start-up neither delay
init() nor get anything but the handshake's challenge."""

import os

import pytest

START_TIMEOUT_S = 60.0


def _socket_inodes(pid):
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours to look at
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _listening(pid):
    """Rank ``pid``'s listening sockets, read from /proc: TCP (host, port) pairs and unix names."""
    inodes = _socket_inodes(pid)
    found = []
    with open("/proc/net/tcp") as table:
        for row in list(table)[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ip_hex, port_hex = cols[1].split(":")
                host = ".".join(str(int(ip_hex[i:i + 2], 16)) for i in (6, 4, 2, 0))
                found.append((host, int(port_hex, 16)))
    with open("/proc/net/unix") as table:
        for row in list(table)[1:]:
            cols = row.split()
            if len(cols) >= 8 and int(cols[3], 16) & 0x10000 and cols[6] in inodes:  # __SO_ACCEPTCON
                found.append("\0" + cols[7][1:] if cols[7].startswith("@") else cols[7])
    return found


def _rank0_pids(secret):
    """Processes with rank 0's worker environment: the rank itself, and the launcher's supervisor
    of it, which has no sockets."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"SPARK_HVD_SECRET") == secret.encode() and env.get(b"SPARK_HVD_RANK") == b"0":
            pids.append(int(entry))
    return pids


def _start_with_strangers(per_listener):
    import socket
    import time

    import numpy as np

    import spark_hvd.runtime as rt
    from spark_hvd.runtime.config import read_setting

    strangers = []
    if read_setting("rank") == 1:
        # Rank 0 listens before it waits for us at the rendezvous: occupy its sockets first.
        deadline = time.monotonic() + 30
        addresses = []
        # Both kinds: the TCP listener and the unix control socket are opened one after the other.
        while time.monotonic() < deadline and not (any(isinstance(a, tuple) for a in addresses)
                                                   and any(isinstance(a, str) for a in addresses)):
            addresses = [a for pid in _rank0_pids(read_setting("secret")) for a in _listening(pid)]
            time.sleep(0.02)
        assert addresses, "rank 0's listening sockets were not found"
        for address in addresses:
            for _ in range(per_listener):
                if isinstance(address, tuple):
                    sock = socket.create_connection(address, timeout=10)
                else:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.settimeout(10)
                    sock.connect(address)
                strangers.append(sock)
        for sock in strangers[::5]:
            sock.sendall(b"\x80\x05 not a proof " * 6)
    started = time.monotonic()
    rt.init()
    took = time.monotonic() - started
    total = float(rt.allreduce(np.array([1.0]), op=rt.Sum, name="after.strangers")[0])
    outcomes = []
    for sock in strangers:
        received, outcome = b"", "open"
        try:
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    outcome = "closed"
                    break
                received += chunk
        except ConnectionResetError:
            outcome = "closed"
        except socket.timeout:
            pass
        outcomes.append((outcome, len(received)))
        sock.close()
    rt.shutdown()
    return took, total, outcomes


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp-data"])
def test_strangers_do_not_delay_start_up(launch, shm):
    """Twenty idle connections on each of rank 0's listening sockets (TCP, and its abstract unix
    control socket), a few of them sending garbage, opened before rank 1 connects: init()
    completes on both ranks well within the start timeout, the job computes, and every stranger
    received only the 32-byte challenge before being closed."""
    results = launch(_start_with_strangers, np=2, args=(20,),
                     settings={"start_timeout": START_TIMEOUT_S, "shm": shm})
    for rank, (took, total, _) in enumerate(results):
        print(f"rank {rank}: init() took {took:.2f} s")
        assert took < START_TIMEOUT_S / 2
        assert total == 2.0
    outcomes = results[1][2]
    assert len(outcomes) >= 40  # TCP and unix listeners, 20 each
    assert all(outcome == ("closed", 32) for outcome in outcomes), outcomes
