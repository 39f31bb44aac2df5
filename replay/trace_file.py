"""The trace recorder's files: JSON Lines appended one complete line per write, created 0600, rotated at a
size cap. Format-agnostic: the recorder (``gateway/tracing.py``) hands in encoded lines and its header line.

Why it works this way:

- **Written from the event loop, one ``write(2)`` per request, no fsync.** A record is one line of a few KB
  (about 5 bytes per token id), and writing it to the page cache takes microseconds, less than encoding it;
  rotation is a few renames. A writer thread would add a queue, a drop rule for when it is full and an
  ordering problem at shutdown, to save that. What is not done per request is ``fsync``: the kernel flushes,
  so a machine crash (not a gateway crash) can lose the last seconds of records, never corrupt earlier ones.
- **A complete line or nothing.** A short write is continued; a failed one (disk full) truncates the file
  back to where the line began and raises, so a file always ends with a newline and stays readable by
  ``policies.trace.read_trace``. A new file whose header cannot be written is removed.
- **0600 whatever the umask.** Created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600, then
  ``fchmod(0600)``: the umask can only take bits away from the mode given to ``open``, never add them, and
  the explicit ``fchmod`` makes the mode exact. ``O_EXCL``: the recorder never appends to a file it did not
  create (a previous run's file at the path is rotated away first), so every line of a file follows that
  file's own header.
- **Rotation.** When the next line would take the file past ``max_bytes``, ``path`` becomes ``path.1`` (the
  previous ``path.1`` becomes ``path.2``, and so on; beyond ``path.{keep}`` files are deleted) and a new
  ``path`` starts with a fresh header. Every file is a whole trace. A line that cannot fit in an empty file
  with its header is refused (:class:`TooLarge`) without rotating.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

_FLAGS = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL
          | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
MODE = 0o600


class TooLarge(ValueError):
    """One record (with a header) is larger than ``max_bytes``: it would not fit in any file."""


def directory_problem(path: Path) -> str | None:
    """Why ``path``'s folder cannot hold the trace (None when it can); a startup or reload error."""
    folder = path.parent
    if not folder.is_dir():
        return f"folder {folder} does not exist; create it or change the trace path"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"folder {folder} is not writable by this process"
    if path.is_dir():
        return f"{path} is a folder; name a file"
    return None


class TraceFile:
    """Appends lines to ``path``, rotating as the module docstring says. Opened on the first write."""

    def __init__(self, path: Path, *, max_bytes: int, keep: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self.size = 0  # bytes in the current file
        self._fd: int | None = None

    def write(self, line: bytes, header: Callable[[], bytes]) -> None:
        """Append ``line`` (one JSON line with its newline); ``header()`` is the first line of a new file.
        Raises ``TooLarge``, or ``OSError`` with the file as it was before the call."""
        if self._fd is not None and self.size + len(line) <= self.max_bytes:
            self._append(line)
            return
        head = header()
        if len(head) + len(line) > self.max_bytes:
            raise TooLarge(f"a record of {len(line)} bytes does not fit in max_bytes {self.max_bytes} with its header")
        self._rotate()
        self._start(head)
        self._append(line)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def files(self) -> list[dict[str, object]]:
        """The current file and the rotated ones kept, newest first, with their sizes."""
        out = []
        for path in [self.path, *(self.rotated(i) for i in range(1, self.keep + 1))]:
            try:
                out.append({"path": str(path), "bytes": os.stat(path).st_size})
            except OSError:
                continue
        return out

    def rotated(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{n}")

    # -- internals ---------------------------------------------------------------------------------

    def _rotate(self) -> None:
        """Move the current file (this run's, or one found at the path) to ``path.1``, shifting the rest."""
        self.close()
        if self.keep == 0:
            self.path.unlink(missing_ok=True)
            return
        self.rotated(self.keep).unlink(missing_ok=True)
        for n in range(self.keep - 1, 0, -1):
            if os.path.lexists(self.rotated(n)):
                os.replace(self.rotated(n), self.rotated(n + 1))
        if os.path.lexists(self.path):
            os.replace(self.path, self.rotated(1))

    def _start(self, head: bytes) -> None:
        fd = os.open(self.path, _FLAGS, MODE)
        try:
            os.fchmod(fd, MODE)
            self._fd, self.size = fd, 0
            self._append(head)
        except OSError:
            if self._fd is None:
                os.close(fd)
            self.close()
            self.path.unlink(missing_ok=True)
            raise

    def _append(self, data: bytes) -> None:
        assert self._fd is not None
        start, view = self.size, memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise
        self.size += len(data)
