"""OutputFollower: lines of the per-rank files mpiexec writes, handed on whole and in order."""

from spark_hvd.runner.follow import OutputFollower


def test_lines_are_handed_on_whole_as_the_files_grow(tmp_path):
    got = []
    follower = OutputFollower(tmp_path, 2, sink=lambda rank, stream, line: got.append((rank, stream, line)))
    assert [p.name for p in follower.prepare()] == ["rank.0", "rank.1"]
    assert follower.poll() == 0  # nothing written yet: no file is an error
    out0 = tmp_path / "rank.0" / "stdout"
    with open(out0, "ab") as f:
        f.write(b"first li")
    assert follower.poll() == 0 and got == []
    with open(out0, "ab") as f:
        f.write(b"ne\r\nsecond\n\nthird")
    (tmp_path / "rank.1" / "stderr").write_bytes(b"\xff broken utf-8\n")
    assert follower.poll() == 4
    assert got == [(0, "stdout", "first line"), (0, "stdout", "second"), (0, "stdout", ""),
                   (1, "stderr", "\ufffd broken utf-8")]
    follower.stop()  # the last line has no newline: handed on at the end
    assert got[-1] == (0, "stdout", "third")


def test_a_line_that_never_ends_comes_in_pieces_and_a_broken_sink_is_dropped(tmp_path):
    got = []

    def sink(rank, stream, line):
        got.append(len(line))
        if len(got) == 2:
            raise RuntimeError("the terminal went away")

    follower = OutputFollower(tmp_path, 1, sink=sink, interval=0.01)
    follower.prepare()
    (tmp_path / "rank.0" / "stdout").write_bytes(b"x" * (3 * 65536 + 10))
    follower.start()
    follower.stop()
    assert got == [65536, 65536]  # the sink failed on the second piece; the rest is read and dropped
