"""The checkpoint format: one directory per step, one tensor file per rank, a small manifest.

    <root>/step_00000100/
        rank00000.pt ...      tensors this rank owns (torch.save; loaded with weights_only=True)
        manifest.json         step, config, layout, extra; every logical tensor's global shape,
                              dtype and where its shard list lies in shards.jsonl; the number
                              of files; size and sha256 of the two tables below. O(model), not
                              O(world): it is what the resume round broadcasts.
        shards.jsonl          one line per tensor (sorted by name): [[file no, offsets, lengths], ...]
        files.idx             fixed-width records, one per file no: size and sha256 (a rank seeks
                              to the records of the files it reads)
        owned.jsonl           one line per file no: the shards it holds, [[name, offsets, lengths], ...]
        owned.idx             fixed-width records, one per file no: where its line lies in owned.jsonl
    <root>/latest             name of the newest complete checkpoint, replaced atomically

A shard is described in global coordinates (offsets and lengths per dimension, as Megatron's
ShardedTensor does), so loading into another layout is a matter of intersecting slices. A rank
reads the records of the files it reads, never a whole table. Resuming into the layout it was
saved from, a rank reads the owned.jsonl lines of the files that hold its slices (its own, or a
replica's: `read_for`): O(its own shards), whatever tp x dp; a tensor line of shards.jsonl lists
every rank's piece of that tensor (O(tp x dp) under ZeRO) and is read only for what those lines
do not cover (another layout: resharding). Format 1 (everything in manifest.json), and format 2
without the owned tables, are still read.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from threefold.atomic import atomic_write
from threefold.errors import UserError

FORMAT = "threefold-checkpoint/2"
LEGACY = "threefold-checkpoint/1"
MANIFEST, SHARDS, FILES = "manifest.json", "shards.jsonl", "files.idx"
OWNED, OWNED_INDEX = "owned.jsonl", "owned.idx"
LATEST = "latest"
RECORD = 86  # one files.idx record: 20-digit size, space, 64 hex digits of sha256, newline
OWNED_RECORD = 42  # one owned.idx record: 20-digit offset, space, 20-digit length, newline


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, corrupted or does not fit the model."""


def file_name(number: int) -> str:
    return f"rank{number:05d}.pt"


def file_number(name: str) -> int:
    return int(name.removeprefix("rank").removesuffix(".pt"))


def shard_key(name: str, offsets) -> str:
    """A shard's key in its file: a rank may hold several rectangles of one tensor (ZeRO cuts
    anywhere), so the name and the offsets."""
    return f"{name}@{','.join(map(str, offsets))}"


@dataclass
class Shard:
    file: str
    key: str
    offsets: list[int]
    lengths: list[int]


@dataclass
class TensorEntry:
    shape: list[int]
    dtype: str
    shards: list[Shard] | None = field(default_factory=list)
    """None until read: its line in shards.jsonl lies at `at` = [byte offset, length]."""
    at: list[int] | None = None


@dataclass
class Manifest:
    step: int
    config: dict
    layout: dict
    tensors: dict[str, TensorEntry]
    files: dict[str, dict]
    """{file name: {"bytes", "sha256"}}: the records read so far (all of them after read(whole=True))."""
    extra: dict = field(default_factory=dict)
    format: str = FORMAT
    count: int = 0
    """Shard files rank00000.pt .. rank{count-1}."""
    index: dict = field(default_factory=dict)
    """{SHARDS: [bytes, sha256], FILES: [bytes, sha256]}: the two tables, checked by verify_index."""

    def header(self) -> dict:
        """manifest.json: everything but the shard and file tables (O(model), not O(world))."""
        tensors = {n: {"shape": e.shape, "dtype": e.dtype, "at": e.at} for n, e in self.tensors.items()}
        keys = ("format", "step", "config", "layout", "extra", "count", "index")
        return {**{k: getattr(self, k) for k in keys}, "tensors": tensors}

    def to_json(self) -> str:
        return json.dumps(self.header() if self.format == FORMAT else asdict(self), indent=1, sort_keys=True)

    @classmethod
    def read(cls, directory: Path, whole: bool = True) -> Manifest:
        """manifest.json; with `whole` also every shard line and file record (tools: O(world))."""
        path = directory / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(
                f"{directory}: no {MANIFEST} (not a threefold checkpoint, or an unfinished save)"
            ) from None
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path}: unreadable manifest ({err})") from None
        fmt = data.get("format")
        if fmt == LEGACY:  # every shard and file in manifest.json
            tensors = {
                name: TensorEntry(e["shape"], e["dtype"], [Shard(**s) for s in e["shards"]])
                for name, e in data["tensors"].items()
            }
            return cls(data["step"], data["config"], data["layout"], tensors, data["files"], data.get("extra", {}), fmt)
        if fmt != FORMAT:
            raise CheckpointError(f"{path}: format {fmt!r} is not {FORMAT!r} (or {LEGACY!r})")
        tensors = {name: TensorEntry(e["shape"], e["dtype"], None, e["at"]) for name, e in data["tensors"].items()}
        keys = ("step", "config", "layout")
        manifest = cls(*(data[k] for k in keys), tensors, {}, data["extra"], fmt, data["count"], data["index"])
        if whole:
            manifest.read_shards(directory, list(tensors))
            manifest.read_files(directory, [file_name(n) for n in range(manifest.count)])
        return manifest

    def read_shards(self, directory: Path, names) -> None:
        """Fill the shard lists of the tensors `names` (those not read yet) from shards.jsonl."""
        todo = sorted(
            (self.tensors[n].at, n) for n in set(names) if n in self.tensors and self.tensors[n].shards is None
        )
        if not todo:
            return
        path = directory / SHARDS
        try:
            with open(path, "rb") as f:
                for (offset, length), name in todo:
                    f.seek(offset)
                    rows = json.loads(f.read(length))
                    shards = [Shard(file_name(no), shard_key(name, o), o, n) for no, o, n in rows]
                    self.tensors[name].shards = shards
        except (OSError, ValueError, TypeError) as err:
            raise CheckpointError(f"{path}: unreadable shard table ({err})") from None

    def read_for(self, directory: Path, tensors) -> None:
        """Fill the shard lists `tensors` (LocalTensors: name, offsets, lengths, source) are loaded
        from. Where the owned tables exist and a tensor names its `source` (the rank whose file
        holds that slice in this run's layout), the owned lines of those files come first: each
        tensor they cover whole gets just the shards that cover it. The rest take their tensor
        lines (read_shards: every piece of the tensor)."""
        sources = {t.source for t in tensors if getattr(t, "source", None) is not None}
        todo = [t for t in tensors if t.name in self.tensors and self.tensors[t.name].shards is None]
        if sources and OWNED_INDEX in self.index and todo:
            found: dict[str, list[Shard]] = {}
            for no, rows in self._read_owned(directory, sorted(sources)):
                for name, offsets, lengths in rows:
                    found.setdefault(name, []).append(Shard(file_name(no), shard_key(name, offsets), offsets, lengths))
            chosen: dict[str, dict[str, Shard]] = {}  # name -> {shard key: shard}
            covered: dict[str, bool] = {}
            for t in todo:
                mine = [s for s in found.get(t.name, []) if _meet(s, t)]
                whole = sum(_meet(s, t) for s in mine) == _volume(t.lengths)  # shards never overlap
                covered[t.name] = covered.get(t.name, True) and whole
                chosen.setdefault(t.name, {}).update((s.key, s) for s in mine)
            for name, shards in chosen.items():
                if covered[name]:
                    self.tensors[name].shards = list(shards.values())
        self.read_shards(directory, [t.name for t in todo])

    def _read_owned(self, directory: Path, numbers: list[int]):
        """(file no, its owned line's rows) for each of `numbers`: two seeks each."""
        try:
            with open(directory / OWNED_INDEX, "rb") as index, open(directory / OWNED, "rb") as table:
                for no in numbers:
                    if not 0 <= no < self.count:
                        raise ValueError(f"no record of {file_name(no)} ({self.count} files)")
                    index.seek(no * OWNED_RECORD)
                    offset, length = map(int, index.read(OWNED_RECORD).split())
                    table.seek(offset)
                    yield no, json.loads(table.read(length))
        except (OSError, ValueError, TypeError) as err:
            raise CheckpointError(f"{directory}: unreadable owned tables ({err})") from None

    def read_files(self, directory: Path, names) -> None:
        """Fill the records (size, sha256) of the files `names` from files.idx."""
        todo = sorted(file_number(n) for n in set(names) if n not in self.files)
        if not todo:
            return
        path = directory / FILES
        try:
            with open(path, "rb") as f:
                for no in todo:
                    if not 0 <= no < self.count:
                        raise ValueError(f"no record of {file_name(no)} ({self.count} files)")
                    f.seek(no * RECORD)
                    size, sha = f.read(RECORD).decode().split()
                    self.files[file_name(no)] = {"bytes": int(size), "sha256": sha}
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path}: unreadable file table ({err})") from None


def _meet(shard: Shard, t) -> int:
    """Elements a shard and a local slice share."""
    n = 1
    for a, la, b, lb in zip(shard.offsets, shard.lengths, t.offsets, t.lengths):
        n *= max(0, min(a + la, b + lb) - max(a, b))
    return n


def _volume(lengths) -> int:
    n = 1
    for x in lengths:
        n *= x
    return n


def build(
    step: int, config: dict, layout: dict, extra: dict, reports: list[dict]
) -> tuple[Manifest, dict[str, str], str]:
    """The manifest, the text of the shard tables (shards.jsonl, owned.jsonl and owned.idx, by
    name) and of files.idx from every rank's report (in rank order: report i describes
    rank{i}.pt): {"bytes", "sha256", "shards": [(name, shape, dtype, offsets, lengths), ...]}.
    Rank 0's O(world) work, once per save."""
    found: dict[str, tuple] = {}
    for no, report in enumerate(reports):
        for name, shape, dtype, offsets, lengths in report["shards"]:
            entry = found.setdefault(name, (list(shape), dtype, []))
            if entry[:2] != (list(shape), dtype):
                raise CheckpointError(f"rank {no} saves {name} as {shape} {dtype}, another rank as {entry[:2]}")
            entry[2].append([no, list(offsets), list(lengths)])
    tensors, lines, at = {}, [], 0
    for name in sorted(found):
        shape, dtype, rows = found[name]
        line = json.dumps(rows, separators=(",", ":")) + "\n"
        tensors[name] = TensorEntry(shape, dtype, None, [at, len(line)])
        lines.append(line)
        at += len(line)
    files = "".join(f"{r['bytes']:020d} {r['sha256']}\n" for r in reports)
    owned, records, at = [], [], 0
    for report in reports:
        rows = [[name, list(offsets), list(lengths)] for name, _, _, offsets, lengths in report["shards"]]
        line = json.dumps(rows, separators=(",", ":")) + "\n"
        owned.append(line)
        records.append(f"{at:020d} {len(line):020d}\n")
        at += len(line)
    tables = {SHARDS: "".join(lines), OWNED: "".join(owned), OWNED_INDEX: "".join(records)}
    return Manifest(step, config, layout, tensors, {}, extra, FORMAT, len(reports)), tables, files


def write_tables(directory: Path, manifest: Manifest, shards: dict[str, str], files: str) -> None:
    """The shard tables (`shards`, by name) and files.idx (fsynced), their sizes and checksums
    into the manifest, then manifest.json, atomically: a directory with a manifest has its tables."""
    for name, text in (*shards.items(), (FILES, files)):
        data = text.encode()
        with open(directory / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        manifest.index[name] = [len(data), hashlib.sha256(data).hexdigest()]
    atomic_write(directory / MANIFEST, manifest.to_json())


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_file(path: Path, size: int, sha: str, what: str) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path.parent}: {what} {path.name} is missing")
    if path.stat().st_size != size:
        raise CheckpointError(f"{path}: {path.stat().st_size} bytes, manifest says {size}")
    if sha256_of(path) != sha:
        raise CheckpointError(f"{path}: checksum mismatch (file corrupted)")


def verify_index(directory: Path, manifest: Manifest) -> None:
    """The shard and file tables are those the manifest was written with (rank 0, on resume)."""
    for name, (size, sha) in manifest.index.items():
        _check_file(directory / name, size, sha, "table")


def verify(directory: Path, manifest: Manifest, files=None) -> None:
    """The files `files` (None: every file, and the tables) exist with their recorded size and
    checksum; their records are read first."""
    if files is None:
        verify_index(directory, manifest)
        files = [file_name(n) for n in range(manifest.count)] if manifest.format == FORMAT else list(manifest.files)
    files = sorted(files)
    manifest.read_files(directory, files)
    for name in files:
        meta = manifest.files[name]
        _check_file(directory / name, meta["bytes"], meta["sha256"], "shard file")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Published checkpoint directories (never *.tmp ones), newest first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")]
    return sorted(dirs, key=lambda p: p.name, reverse=True)
