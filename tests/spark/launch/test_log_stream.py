"""The driver's log collector: strangers cost nothing, corrupt frames are cut off, long lines fit."""

import io
import json
import socket
import threading

from spark_hvd.runtime.config import new_secret
from spark_hvd.runtime.wire import authenticate_client, secret_bytes
from spark_hvd.spark.launch.log_stream import _FIELD_CHARS, FRAME_LIMIT, LogCollector, LogSender, _shortened
from harness import wait_until


def _rss_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_idle_strangers_neither_delay_output_nor_cost_threads():
    """With 200 idle connections on the collector, a task's sender still connects, its lines and
    its failure arrive, and the collector runs no thread per connection."""
    secret = new_secret()
    out, err = io.StringIO(), io.StringIO()
    before = threading.active_count()
    collector = LogCollector("127.0.0.1", "127.0.0.1", secret, out, err)
    strangers = []
    try:
        host, port = collector.address.rsplit(":", 1)
        strangers = [socket.create_connection((host, int(port)), timeout=10) for _ in range(200)]
        assert wait_until(lambda: collector.waiting + collector.rejected == len(strangers), 20.0), collector.waiting
        assert threading.active_count() <= before + 1  # the collector's own thread
        sender = LogSender(collector.address, secret, rank=1, timeout=20.0)
        assert sender.connected, sender.problem
        assert sender.line("stdout", "hello") and sender.line("stderr", "oops")
        assert sender.failure({"type": "ValueError", "message": "bad", "traceback": "tb", "output_tail": ""})
        sender.close()
        assert collector.wait_closed(1, 20.0)
        assert out.getvalue() == "[1]<stdout>:hello\n" and err.getvalue() == "[1]<stderr>:oops\n"
        assert collector.wait_failure(5.0)["message"] == "bad"
    finally:
        for s in strangers:
            s.close()
        collector.close()


def test_oversize_frame_is_cut_off_without_allocating():
    """An authenticated connection announcing a 1 GiB frame is closed and counted as closed; the
    driver's memory does not grow by the announced size."""
    secret = new_secret()
    collector = LogCollector("127.0.0.1", "127.0.0.1", secret, io.StringIO(), io.StringIO())
    try:
        host, port = collector.address.rsplit(":", 1)
        before = _rss_mib()
        raw = socket.create_connection((host, int(port)), timeout=10)
        authenticate_client(raw, secret_bytes(secret), 10.0)
        raw.sendall((1 << 30).to_bytes(8, "big") + b"{" * 1000)
        try:
            closed = raw.recv(1) == b""
        except ConnectionResetError:
            closed = True
        raw.close()
        assert closed
        assert collector.wait_closed(1, 10.0)
        assert _rss_mib() - before < 64
    finally:
        collector.close()


def test_strangers_are_rejected_and_counted():
    """A garbage sender is closed and counted as rejected; it never counts as a task connection."""
    secret = new_secret()
    collector = LogCollector("127.0.0.1", "127.0.0.1", secret, io.StringIO(), io.StringIO())
    try:
        host, port = collector.address.rsplit(":", 1)
        raw = socket.create_connection((host, int(port)), timeout=10)
        assert len(raw.recv(32)) == 32
        raw.sendall(json.dumps({"rank": 0, "error": {"message": "forged"}}).encode().ljust(64))
        assert raw.recv(1) == b""
        raw.close()
        assert wait_until(lambda: collector.rejected == 1, 10.0)
        assert collector.failures == [] and not collector.wait_closed(1, 0.2)
    finally:
        collector.close()


def test_long_fields_are_shortened_to_fit_a_frame():
    """A line or failure report too large for one frame is cut: the start of a line, the end of a
    traceback, and the whole report fits in FRAME_LIMIT."""
    huge = "\u2603" * (_FIELD_CHARS + 1000)  # escapes to 6 bytes per character in JSON
    line = _shortened({"rank": 0, "stream": "stdout", "text": "first " + huge})
    assert line["text"].startswith("first ") and "characters cut" in line["text"]
    failure = _shortened({"rank": 0, "error": {"type": "E", "message": "m", "traceback": huge + " last frame",
                                                "output_tail": huge, "exception": "QUJD" * (FRAME_LIMIT // 8)}})
    assert failure["error"]["traceback"].endswith(" last frame")
    assert failure["error"]["exception"] is None
    assert len(json.dumps(line).encode()) <= FRAME_LIMIT
    assert len(json.dumps(failure).encode()) <= FRAME_LIMIT
