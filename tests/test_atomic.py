"""threefold.atomic: a file is replaced whole or not at all, no temp file outlives a write, and
concurrent writers of one path end with one whole copy."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from threefold.atomic import PendingFile, atomic_open, atomic_write

ROOT = Path(__file__).resolve().parents[1]


def test_bytes_and_text_are_published_whole_and_no_temp_is_left(tmp_path):
    path = tmp_path / "out.bin"
    atomic_write(path, b"\x00\x01" * 1000)
    assert path.read_bytes() == b"\x00\x01" * 1000
    atomic_write(path, "größe\n")
    assert path.read_bytes() == "größe\n".encode()
    with atomic_open(path, text=True) as fh:
        fh.write("line one\n")
        fh.write("λ line two\n")
    assert path.read_text(encoding="utf-8") == "line one\nλ line two\n"
    assert os.listdir(tmp_path) == ["out.bin"]


def test_an_exception_in_the_block_keeps_the_old_file_and_removes_the_temp(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="half way"), atomic_open(path) as fh:
        fh.write(b"new but unfinished")
        raise RuntimeError("half way")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["out.json"]


def test_a_failed_rename_removes_the_temp(tmp_path):
    path = tmp_path / "taken"
    path.mkdir()  # a directory: the rename over it fails
    (path / "inside").write_text("x")
    with pytest.raises(OSError):
        atomic_write(path, b"data")
    assert os.listdir(tmp_path) == ["taken"]
    assert os.listdir(path) == ["inside"]


def test_a_pending_file_appears_only_on_publish_and_discard_leaves_the_old_one(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"old")
    pending = PendingFile(path)
    pending.file.write(b"new")
    assert path.read_bytes() == b"old"
    pending.discard()
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["tokens.bin"]

    pending = PendingFile(path)
    pending.file.write(b"new")
    pending.publish()
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["tokens.bin"]


def test_each_writer_has_a_private_temp_beside_the_destination(tmp_path):
    path = tmp_path / "cache.json"
    first, second = PendingFile(path), PendingFile(path)
    try:
        assert first.temp != second.temp
        assert first.temp.parent == second.temp.parent == tmp_path  # a rename never crosses a file system
        assert first.temp.name.startswith(".cache.json.") and first.temp.name.endswith(".tmp")
    finally:
        first.discard()
        second.discard()


def test_the_file_and_then_its_directory_are_fsynced(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    atomic_write(tmp_path / "run.json", "{}")
    assert synced == ["file", "dir"]


WRITER = textwrap.dedent(
    """
    import sys
    from threefold.atomic import atomic_write

    path, byte, rounds = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
    for _ in range(rounds):
        atomic_write(path, byte * (1 << 18))
    """
)


def test_two_processes_writing_one_path_end_with_one_whole_copy(tmp_path):
    """Two ranks write the same file at once while a reader keeps reading it: every read and
    the final file are one writer's whole copy."""
    path = tmp_path / "shared.bin"
    copies = {b"a" * (1 << 18), b"b" * (1 << 18)}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), byte, "150"], env=env, stderr=subprocess.PIPE)
        for byte in "ab"
    ]
    reads = 0
    while any(w.poll() is None for w in writers):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        assert data in copies, f"a reader saw {len(data)} bytes that are neither copy"
        reads += 1
    errors = [w.stderr.read().decode() for w in writers]
    assert [w.returncode for w in writers] == [0, 0], errors
    assert path.read_bytes() in copies
    assert os.listdir(tmp_path) == ["shared.bin"]
    assert reads > 0
