"""One stack on every rank, checked before the first step: each rank's fingerprint
(fingerprint.py) compared with the majority's, each difference named in one line by its ranks
and nodes, and every distinct stack checked against the known-bad table (known_bad.toml).

The exchange costs every rank O(1), whatever the world size:
1. each rank hashes the hard and the soft keys of its fingerprint (two 128-bit digests) and
   rank 0 gathers one record of RECORD int64 words per rank: the digests and the rank's node;
2. rank 0 takes each kind's majority digest and broadcasts a plan of PLAN words: the ranks
   whose full fingerprint it needs, the first holder of each distinct digest (at most
   MAX_STACKS of each kind, the majority's among them);
3. those ranks, and only they, send their fingerprint to rank 0, which names the differences;
4. rank 0 broadcasts the verdict (hard, soft), so every rank stops or trains alike.
"""

from __future__ import annotations

import functools
import json
import re
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from threefold.distributed import comm
from threefold.preflight.fingerprint import comparable, digest, is_environment
from threefold.preflight.nodes import node_index, rank_ranges, where

RECORD = 5
"""Words of one rank's record: hard digest (2), soft digest (2), node."""
MAX_STACKS = 16
"""Distinct stacks of each kind whose fingerprint rank 0 fetches; more are counted, not named."""
PLAN = 2 * MAX_STACKS
KINDS = ("hard", "soft")
TABLE = Path(__file__).with_name("known_bad.toml")
PREFIX = "threefold: stack:"

# How a line says what a group of ranks has: (phrase with the value, the same for the majority,
# the phrase when the key is absent). Hashes are shown by their first 12 characters.
PHRASES = {
    "python": ("run Python {v}", "run {v}", "Python"),
    "torch": ("run torch {v}", "run {v}", "torch"),
    "torch_git": ("run torch built from commit {v}", "run {v}", "torch commit"),
    "torch_build": ("run a torch built for {v}", "run one built for {v}", "torch build"),
    "cuda_runtime": ("load CUDA runtime {v}", "load {v}", "CUDA runtime"),
    "cuda_driver": ("have driver {v}", "have {v}", "driver"),
    "cudnn": ("load cuDNN {v}", "load {v}", "cuDNN"),
    "nccl": ("load NCCL {v}{path}", "load {v}", "NCCL"),
    "nccl_sha256": ("load an NCCL library of sha256 {v}{path}", "load one of sha256 {v}", "NCCL library"),
    "nccl_path": ("load NCCL from {v}", "load it from {v}", "NCCL library"),
    "threefold": ("run threefold {v}", "run {v}", "threefold version"),
    "threefold_source": ("run threefold source {v}", "run {v}", "threefold source"),
    "numpy": ("run numpy {v}", "run {v}", "numpy"),
    "triton": ("run triton {v}", "run {v}", "triton"),
    "device_name": ("have device {v}", "have {v}", "device"),
    "device_count": ("see {v} devices", "see {v}", "device count"),
    "device_memory": ("have {v} of device memory", "have {v}", "device memory"),
    "gpu_sm_clock_max": ("have a maximum SM clock of {v}", "have {v}", "SM clock"),
    "gpu_sm_clock_app": ("run the SM clock at {v}", "run it at {v}", "application clock"),
    "gpu_ecc": ("have ECC {v}", "have it {v}", "ECC mode"),
    "gpu_power_limit": ("have a power limit of {v}", "have {v}", "power limit"),
    "cpu_model": ("have CPU {v}", "have {v}", "CPU model"),
    "cpu_cores": ("may use {v} CPU cores", "may use {v}", "CPU core count"),
}
HASHES = frozenset({"torch_git", "nccl_sha256", "threefold_source"})
# A difference that follows from another one named for the same ranks gets no line of its own
# (it stays in the record): another NCCL version is another library, and usually another path.
IMPLIED_BY = {"nccl_sha256": "nccl", "nccl_path": "nccl", "torch_git": "torch", "threefold_source": "threefold"}


@dataclass
class StackReport:
    hard: bool
    """A hard key differs between ranks, or a hard known-bad entry matches: stop before step 1."""
    soft: bool
    """A soft key differs, or a soft known-bad entry matches: warn."""
    lines: list[str]
    """One finding a line (rank 0; [] on the others)."""
    record: dict
    """For preflight.json (rank 0; {} on the others): the majority's stack, the differences."""
    fingerprint: dict
    """This rank's fingerprint."""


def check_stack(grid, device: torch.device, fp: dict) -> StackReport:
    """Compare every rank's fingerprint `fp` (collective over grid.world; see the module's
    docstring). Every rank returns the same hard and soft flags."""
    world = grid.world
    words = [*digest(fp, "hard"), *digest(fp, "soft"), node_index(grid.global_rank)]
    table = comm.gather_dim0(torch.tensor([words], dtype=torch.int64, device=device), world)
    plan = torch.full((PLAN,), -1, dtype=torch.int64, device=device)
    census = None
    if world.rank == 0:
        census = Census(table.tolist(), world.ranks)
        wanted = census.wanted()
        plan[: len(wanted)] = torch.tensor(wanted, dtype=torch.int64)
    comm.broadcast(plan, world)
    wanted = [index for index in plan.tolist() if index >= 0]  # indices in the world group
    if world.rank == 0:
        fingerprints = {0: fp}
        for index in wanted:
            fingerprints[index] = json.loads(comm.recv_bytes(world, index))
        found = census.judge(fingerprints, known_bad())
        verdict = torch.tensor([found.hard, found.soft], dtype=torch.int64, device=device)
    else:
        if world.rank in wanted:
            comm.send_bytes(json.dumps(fp).encode(), world, 0)
        verdict = torch.zeros(2, dtype=torch.int64, device=device)
    comm.broadcast(verdict, world)
    hard, soft = verdict.tolist()
    if world.rank != 0:
        return StackReport(bool(hard), bool(soft), [], {}, fp)
    return StackReport(bool(hard), bool(soft), found.lines, found.record, fp)


@dataclass
class Findings:
    hard: bool
    soft: bool
    lines: list[str]
    record: dict


class Census:
    """Rank 0's view of the gathered records: which ranks share each hard and each soft digest,
    most common first (a tie goes to the digest of the lowest rank)."""

    def __init__(self, rows: list[list[int]], ranks: list[int]):
        self.ranks = ranks  # the global rank of each index in the world group
        self.nodes = {ranks[i]: row[4] for i, row in enumerate(rows)}
        self.digest_of = {kind: [tuple(row[2 * k : 2 * k + 2]) for row in rows] for k, kind in enumerate(KINDS)}
        self.members: dict[str, dict[tuple, list[int]]] = {}
        self.order: dict[str, list[tuple]] = {}
        for kind in KINDS:
            members = defaultdict(list)
            for index, d in enumerate(self.digest_of[kind]):
                members[d].append(index)
            self.members[kind] = members
            self.order[kind] = sorted(members, key=lambda d, m=members: (-len(m[d]), m[d][0]))

    def shown(self, kind: str) -> list[tuple]:
        return self.order[kind][:MAX_STACKS]

    def wanted(self) -> list[int]:
        """The indices whose fingerprint rank 0 needs: the first holder of each digest shown."""
        first = {self.members[kind][d][0] for kind in KINDS for d in self.shown(kind)}
        return sorted(first - {0})

    def judge(self, fingerprints: dict[int, dict], entries: tuple[KnownBad, ...]) -> Findings:
        """The lines, flags and record, from the fingerprints of the indices `wanted` named."""
        lines, differences, majority = [], [], {}
        differs_on: dict[int, set[str]] = defaultdict(set)  # index -> keys unlike the majority's
        for kind in KINDS:
            majority.update(comparable(fingerprints[self.members[kind][self.order[kind][0]][0]], kind))
            kind_lines, kind_differences = self._differences(kind, fingerprints, differs_on)
            lines += kind_lines
            differences += kind_differences
        flags = {kind: len(self.order[kind]) > 1 for kind in KINDS}
        bad = self._known_bad(fingerprints, entries)
        for entry, (ranks, values) in bad.items():
            flags[entry.severity] = True
            shown = ", ".join(f"{k} {v}" for k, v in values.items())
            lines.append(
                f"{PREFIX} {where(ranks, self.nodes)} match known-bad {entry.id} ({shown}, {entry.severity}): "
                f"{entry.says}; source: {entry.source}"
            )
        record = {
            "ranks": len(self.ranks),
            "majority": majority,
            "distinct": {kind: len(self.order[kind]) for kind in KINDS},
            "differences": differences,
            "known_bad": [
                {"id": e.id, "severity": e.severity, "ranks": rank_ranges(r), "source": e.source}
                for e, (r, _) in bad.items()
            ],
        }
        return Findings(flags["hard"], flags["soft"], lines, record)

    def _differences(self, kind: str, fingerprints: dict, differs_on: dict) -> tuple[list[str], list[dict]]:
        """One line per (key, value) of this kind unlike the majority's, over every digest shown,
        unless the key's difference follows from one already named for those ranks (IMPLIED_BY);
        one record entry per (key, value) all the same."""
        members, order = self.members[kind], self.order[kind]
        ours = comparable(fingerprints[members[order[0]][0]], kind)
        groups: dict[tuple, tuple[list[int], dict]] = {}
        for d in self.shown(kind)[1:]:
            theirs_fp = fingerprints[members[d][0]]
            theirs = comparable(theirs_fp, kind)
            changed = [key for key in sorted(ours.keys() | theirs.keys()) if ours.get(key) != theirs.get(key)]
            for index in members[d]:
                differs_on[index].update(changed)
            for key in changed:
                groups.setdefault((key, theirs.get(key)), ([], theirs_fp))[0].extend(members[d])
        hidden = [self.ranks[i] for d in order[MAX_STACKS:] for i in members[d]]
        differing = Counter()  # ranks unlike the majority on each key; the hidden ones unknown
        for (key, _), (indices, _) in groups.items():
            differing[key] += len(indices)
        lines, differences = [], []
        for (key, value), (indices, theirs_fp) in sorted(groups.items(), key=lambda g: min(g[1][0])):
            ranks = [self.ranks[i] for i in indices]
            same = len(self.ranks) - differing[key] - len(hidden)
            said = [self.ranks[i] for i in indices if IMPLIED_BY.get(key) not in differs_on[i]]
            if said:
                lines.append(self._line(key, value, theirs_fp, ours.get(key), said, same))
            differences.append(
                {
                    "kind": kind,
                    "key": key,
                    "value": value,
                    "majority": ours.get(key),
                    "ranks": rank_ranges(ranks),
                    "nodes": rank_ranges({self.nodes[r] for r in ranks}),
                }
            )
        if hidden:
            lines.append(
                f"{PREFIX} {where(hidden, self.nodes)} hold {len(order) - MAX_STACKS} more {kind} stacks unlike "
                f"the majority's, not compared key by key (more than {MAX_STACKS} distinct)"
            )
        return lines, differences

    def _line(self, key: str, value, theirs_fp: dict, majority_value, ranks: list[int], same: int) -> str:
        full, _ = phrase(key, value, theirs_fp)
        _, short = phrase(key, majority_value, theirs_fp)
        return (
            f"{PREFIX} {where(ranks, self.nodes)} {conjugate(full, len(ranks) == 1)} "
            f"while {same} rank{'' if same == 1 else 's'} {conjugate(short, same == 1)}"
        )

    def _known_bad(self, fingerprints: dict[int, dict], entries) -> dict:
        """{entry: (ranks, the values it matched)} over every distinct (hard, soft) stack whose
        two halves rank 0 holds: a rank's stack is its hard digest's keys and its soft's."""
        first = {kind: {d: self.members[kind][d][0] for d in self.shown(kind)} for kind in KINDS}
        stacks = defaultdict(list)
        for index in range(len(self.ranks)):
            stacks[tuple(self.digest_of[kind][index] for kind in KINDS)].append(index)
        found: dict = {}
        for (hard, soft), indices in stacks.items():
            if hard not in first["hard"] or soft not in first["soft"]:
                continue
            fp = {**comparable(fingerprints[first["hard"][hard]], "hard")}
            fp.update(comparable(fingerprints[first["soft"][soft]], "soft"))
            for entry in entries:
                if entry.matches(fp):
                    ranks, _ = found.setdefault(entry, ([], {k: fp[k] for k in entry.match}))
                    ranks.extend(self.ranks[i] for i in indices)
        return found


def phrase(key: str, value, fp: dict) -> tuple[str, str]:
    """(what a group of ranks does, the same said of the majority) for `key` = `value`, verb
    first and plural ("load NCCL 2.28.9 from /usr/lib/...", "load 2.30.7"); value None: absent."""
    if is_environment(key):
        if value is None:
            return f"leave {key} unset", "leave it unset"
        return f"set {key}={value}", f"set it to {value}"
    if key not in PHRASES:  # a key only a drill or a newer threefold reports
        if value is None:
            return f"report no {key}", "report none"
        return f"report {key}={value}", f"report {value}"
    full, short, label = PHRASES[key]
    if value is None:
        return f"have no {label}", "have none"
    shown = value[:12] if key in HASHES else value
    path = f" from {fp['nccl_path']}" if fp.get("nccl_path") else ""
    return full.format(v=shown, path=path), short.format(v=shown)


def conjugate(text: str, singular: bool) -> str:
    """'load NCCL ...' -> 'loads NCCL ...' when one rank does it."""
    if not singular:
        return text
    verb, _, rest = text.partition(" ")
    verb = {"have": "has", "may": "may"}.get(verb, verb + "s")
    return f"{verb} {rest}"


def describe_change(old: dict, new: dict) -> str | None:
    """One line naming each hard and soft key that differs between two fingerprints (a
    checkpoint's and this run's), or None when none does; per-host keys are not compared."""
    parts = []
    for kind in KINDS:
        before, after = comparable(old, kind), comparable(new, kind)
        changed = [
            f"{key} {_shown(key, before.get(key))} -> {_shown(key, after.get(key))}"
            for key in sorted(before.keys() | after.keys())
            if before.get(key) != after.get(key)
        ]
        if changed:
            parts.append(f"{kind}: " + ", ".join(changed))
    return "the stack changed: " + "; ".join(parts) if parts else None


def _shown(key: str, value) -> str:
    if value is None:
        return "unset" if is_environment(key) else "none"
    return value[:12] if key in HASHES else value


# --- the known-bad table -----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class KnownBad:
    """One entry of known_bad.toml (its header says how `match` is read)."""

    id: str
    severity: str
    match: dict
    says: str
    source: str

    def matches(self, fp: dict) -> bool:
        return all(key in fp and condition_holds(cond, fp[key]) for key, cond in self.match.items())


@functools.cache
def known_bad(path: Path = TABLE) -> tuple[KnownBad, ...]:
    """The table's entries; a malformed entry is a ValueError naming it."""
    entries = []
    for raw in tomllib.loads(Path(path).read_text())["entry"]:
        name = raw.get("id", "?")
        if set(raw) != {"id", "severity", "match", "says", "source"}:
            raise ValueError(f"{path}: entry {name} needs exactly id, severity, match, says, source")
        if raw["severity"] not in KINDS or not raw["source"].startswith("https://") or not raw["match"]:
            raise ValueError(f"{path}: entry {name}: severity hard or soft, a source address and a match")
        entries.append(KnownBad(**raw))
    return tuple(entries)


_COMPARISON = re.compile(r"\s*(==|!=|>=|<=|<|>)\s*(\S+)\s*")


def condition_holds(condition: str, value: str) -> bool:
    """'>=2.13,<2.17.1' against '2.16.5' (versions by their numbers), else equality."""
    if condition[:1] not in ("<", ">", "=", "!"):
        return condition == value
    have = _numbers(value)
    if have is None:
        return False
    for part in condition.split(","):
        found = _COMPARISON.fullmatch(part)
        want = _numbers(found.group(2)) if found else None
        if want is None:
            raise ValueError(f"known-bad condition {condition!r}: {part!r} is not a version comparison")
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        op = found.group(1)
        if not {"==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, "<": a < b, ">": a > b}[op]:
            return False
    return True


def _numbers(version: str) -> tuple[int, ...] | None:
    """'2.6.0+cu124' -> (2, 6, 0); '2.21.5-1' -> (2, 21, 5)."""
    found = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(n) for n in found.group(0).split(".")) if found else None
