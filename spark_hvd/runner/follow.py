"""Following the output files an ``mpiexec`` writes for each rank, and printing them line by line.

``spark-hvd-run --mpi`` has mpiexec write every rank's stdout and stderr to files of their own
(``-outfile-pattern``/``-errfile-pattern``) and prints each complete line as ``[rank]<stream>:line``,
as the built-in launcher does. mpiexec's own labels (``-prepend-rank``) go wrong when a line
reaches it in two writes while another rank writes too (an unbuffered Python ``print`` writes the
text and the newline separately): the label then lands in the middle of the line.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from .processes import MAX_LINE_BYTES, print_prefixed, rank_output_path

__all__ = ["OutputFollower"]

_READ_BYTES = 1 << 20


class OutputFollower:
    """Reads what has been appended to each rank's output files and hands on complete lines.

    ``poll()`` reads once; ``start()`` polls on a thread every ``interval`` seconds until
    ``stop()``, which reads the rest and hands on any last line that has no newline.
    """

    def __init__(self, directory: Path, num_proc: int, sink: Callable[[int, str, str], None] = print_prefixed,
                 interval: float = 0.05) -> None:
        self._paths: Dict[Tuple[int, str], Path] = {}
        for rank in range(num_proc):
            for stream in ("stdout", "stderr"):
                self._paths[(rank, stream)] = rank_output_path(directory, str(rank), stream)
        self._sink = sink
        self._interval = interval
        self._offsets: Dict[Tuple[int, str], int] = {key: 0 for key in self._paths}
        self._partial: Dict[Tuple[int, str], bytes] = {key: b"" for key in self._paths}
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def poll(self) -> int:
        """Hand on the complete lines written since the last poll; returns how many."""
        count = 0
        for key, path in self._paths.items():
            try:
                with open(path, "rb") as file:
                    file.seek(self._offsets[key])
                    data = file.read(_READ_BYTES)
            except FileNotFoundError:
                continue  # mpiexec creates a file when its rank first writes to it
            if not data:
                continue
            self._offsets[key] += len(data)
            lines = (self._partial[key] + data).split(b"\n")
            rest = lines.pop()
            while len(rest) > MAX_LINE_BYTES:  # a rank that never ends a line is shown in pieces
                lines.append(rest[:MAX_LINE_BYTES])
                rest = rest[MAX_LINE_BYTES:]
            self._partial[key] = rest
            for raw in lines:
                self._emit(key, raw)
            count += len(lines)
        return count

    def _emit(self, key: Tuple[int, str], raw: bytes) -> None:
        sink = self._sink
        try:
            sink(key[0], key[1], raw.decode("utf-8", "replace").rstrip("\r"))
        except Exception:  # a broken sink must not stop the following
            self._sink = lambda rank, stream, line: None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="spark-hvd-mpi-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            self.poll()

    def stop(self) -> None:
        """Stop following: read what is left, then the last lines without a newline."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        while self.poll():
            pass
        for key, rest in self._partial.items():
            if rest:
                self._emit(key, rest)
                self._partial[key] = b""

    def prepare(self) -> List[Path]:
        """Create the rank directories mpiexec writes into (it does not create directories)."""
        made = sorted({path.parent for path in self._paths.values()})
        for directory in made:
            os.makedirs(directory, exist_ok=True)
        return made
