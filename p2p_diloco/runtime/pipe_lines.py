"""A child process's output pipe read into a list of lines, by a thread, with a read-everything-now for the exit.

Why not a thread iterating ``popen.stdout``: a process that exited has written all of its output into the pipe,
but the thread may not have read it yet, so whoever saw the exit and then looked at the lines could miss the last
ones (a CI failure of this kind: a process's stderr line not yet in the list after its end). Waiting for the
pipe's end does not help either: a peer's other processes (p2pd, forks) inherit the pipe and hold it open a while
after the main process exits (measured: 6 of 6 waits in the bootstrap test ran into a 2 s cap).

So the pipe is non-blocking and every read happens under a lock, together with the splitting and the callbacks:
:meth:`LineReader.drain`, called once the process has exited, takes the lock (whatever the thread had read is
then in the list) and reads what is left in the pipe itself, until the pipe says "nothing now". Every byte the
exited process wrote is then a line in the list, or the tail of an unfinished last line.
"""

from __future__ import annotations

import codecs
import io
import os
import select
import threading
from collections.abc import Callable
from typing import BinaryIO

READ_BYTES = 1 << 16


class LineReader:
    """Read ``stream`` (a child's stdout or stderr pipe, binary) into ``lines``, as text mode would.

    Decoded as UTF-8 with invalid bytes replaced, ``\\r\\n`` and ``\\r`` turned into ``\\n`` (what
    ``subprocess.Popen(text=True, errors="replace")`` gives); every line keeps its newline, an unfinished last line
    is kept at the pipe's end.

    Args:
        stream: the pipe; made non-blocking, and kept open by this object.
        lines: the list every line is appended to.
        on_line: called with every line after it is appended (under this reader's lock: in order, never twice at
            once; from the reader thread, or from whoever called :meth:`drain`).
        on_eof: called once, after the last line, when every writer has closed the pipe.
    """

    def __init__(self, stream: BinaryIO, lines: list[str], on_line: Callable[[str], None] | None = None,
                 on_eof: Callable[[], None] | None = None):
        self._stream, self.lines = stream, lines
        self._fd = stream.fileno()
        os.set_blocking(self._fd, False)
        self._on_line, self._on_eof = on_line, on_eof
        self._decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")("replace"), True)
        self._partial = ""
        self._lock = threading.RLock()  # (reentrant: a callback may call drain)
        self.eof = threading.Event()

    def run(self) -> None:
        """The reader thread's loop: wait until the pipe is readable, read it, until its end."""
        poller = select.poll()
        poller.register(self._fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while not self.eof.is_set():
            poller.poll()
            with self._lock:
                self._read()

    def drain(self) -> None:
        """Read now whatever is in the pipe (its writers may still be running). After a process exited: every
        byte it wrote is then in :attr:`lines`, but for an unfinished last line."""
        with self._lock:
            while self._read():
                pass

    def _read(self) -> bool:
        """One read, under the lock; False when the pipe has nothing now, or has ended."""
        if self.eof.is_set():
            return False
        try:
            data = os.read(self._fd, READ_BYTES)
        except BlockingIOError:
            return False
        text = self._partial + self._decoder.decode(data, final=not data)
        *complete, self._partial = text.split("\n")
        for line in complete:
            self._emit(line + "\n")
        if data:
            return True
        if self._partial:  # the end: an unfinished last line is a line
            self._emit(self._partial)
            self._partial = ""
        self.eof.set()
        if self._on_eof is not None:
            self._on_eof()
        return False

    def _emit(self, line: str) -> None:
        self.lines.append(line)
        if self._on_line is not None:
            self._on_line(line)
