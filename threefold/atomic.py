"""The one way threefold replaces a file: write a private temp file in the same directory, fsync
it, rename it over the destination, fsync the directory. A reader sees the old file or the whole
new one, never half, and after a crash the file is one of the two. Several processes may write
the same path at once (ranks building one shared cache, each rank writing run.json): each has
its own temp file and the last rename wins with a whole copy.

Stdlib only, on the lowest floor, so every layer can use it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

# O_EXCL: a temp name is never shared, even if two writers drew the same one.
# O_BINARY (Windows only): no newline translation below the file object.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)


def fsync_dir(path: str | Path) -> None:
    """Make a rename in directory `path` durable. Windows cannot open a directory (its renames
    are durable through the file system's journal), so there it does nothing."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PendingFile:
    """A new version of `path` being written to a private temp file beside it: `file` takes the
    writes, `publish()` puts it in place, `discard()` removes it. For writers whose opening and
    closing are separate calls; otherwise use `atomic_open`."""

    def __init__(self, path: str | Path, text: bool = False):
        self.path = Path(path)
        # Hidden, and unique per process and per call: concurrent writers never share a temp.
        self.temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        # Mode 0o666 less the umask, as a plain open() would make the file.
        fd = os.open(self.temp, _CREATE_FLAGS, 0o666)
        self.file: IO = os.fdopen(fd, "w", encoding="utf-8") if text else os.fdopen(fd, "wb")

    def publish(self) -> None:
        """fsync the temp file, rename it to `path`, fsync the directory."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.temp, self.path)
        except BaseException:
            self.discard()
            raise
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        """Close and remove the temp file; `path` stays as it was."""
        self.file.close()
        self.temp.unlink(missing_ok=True)


@contextmanager
def atomic_open(path: str | Path, text: bool = False) -> Iterator[IO]:
    """A file to stream the new contents of `path` into (binary, or UTF-8 text when `text`);
    published when the block ends normally, removed when it raises."""
    pending = PendingFile(path, text)
    try:
        yield pending.file
    except BaseException:
        pending.discard()
        raise
    pending.publish()


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Replace `path` with `data` (a str is written as UTF-8)."""
    with atomic_open(path) as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
