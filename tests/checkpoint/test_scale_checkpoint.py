"""The checkpoint control plane at scale, simulated in one process with torch's fake process group.

The fake group's collectives return at once without data, so the object collectives of the
metadata rounds are wrapped: each records the pickled size of what this rank sends and receives
and returns what the peers would have sent. Rank 0's peers are synthetic reports built by the
real `report_shards` from every rank's slices (meta tensors); everything else is the real code
path: this rank's file, rank 0's manifest and tables on disk, the resume choice, the load.

One model (32 layers, hidden 512, ZeRO-1 pieces of master weights and both AdamW moments) at
tp2*pp4*dp8 = 64 ranks and tp8*pp16*dp128 = 16,384 ranks; per world, a non-zero rank saves,
rank 0 saves (its gather holds that rank's real report) and resumes, then the non-zero rank
resumes from rank 0's broadcast choice.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, pickle, sys, tempfile, time
from collections import namedtuple
from pathlib import Path
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import threefold.checkpoint.manifest as manifest_mod
from threefold.checkpoint import LocalTensor, choose, load_into
from threefold.checkpoint.io import publish, report_shards, write_shards
from threefold.distributed import comm
from threefold.distributed.grid import RankLayout

H, F, LAYERS = 512, 2048, 32
KINDS = ("model", "optim/exp_avg", "optim/exp_avg_sq")
Slice = namedtuple("Slice", "shape dtype")


def written(layout, rank, real):
    # The slices `rank` writes: its stage's layers, its TP slice, its ZeRO-1 rows over dp (the
    # TP-replicated norms from TP rank 0 only), as threefold.checkpoint.state would give them.
    c, per = layout.coords(rank), LAYERS // layout.pp
    out = []
    for layer in range(c["pp"] * per, (c["pp"] + 1) * per):
        p = f"layers.{layer}."
        for name, shape, dim in [
            (p + "attn.wqkv.weight", (3 * H, H), 0), (p + "attn.wo.weight", (H, H), 1),
            (p + "mlp.w1.weight", (F, H), 0), (p + "mlp.w2.weight", (H, F), 1),
            (p + "norm1.weight", (H,), None), (p + "norm2.weight", (H,), None),
        ]:
            if dim is None and c["tp"]:
                continue
            offsets, lengths = [0] * len(shape), list(shape)
            if dim is not None:
                lengths[dim] //= layout.tp
                offsets[dim] = c["tp"] * lengths[dim]
            lo, hi = c["dp"] * lengths[0] // layout.dp, (c["dp"] + 1) * lengths[0] // layout.dp
            offsets[0], lengths[0] = offsets[0] + lo, hi - lo
            for kind in KINDS:
                # A peer's slice needs only its shape and dtype (for its report): no tensor.
                t = torch.randn(lengths).to(torch.bfloat16) if real else Slice(tuple(lengths), torch.bfloat16)
                out.append(LocalTensor(f"{kind}/{name}", t, shape, tuple(offsets), True))
    return out


def size(obj):
    return len(pickle.dumps(obj))


class Wire:
    # What this rank's object collectives carried; `peers`: what the others would have sent.
    def __init__(self, peers=None, sent_by_root=None):
        self.sent = self.received = 0
        self.peers, self.sent_by_root, self.last_sent = peers, sent_by_root, None
        self.peer_bytes = sum(size(x) for x in peers[1:]) if peers else 0  # measured outside the timed round

    def gather_objects(self, obj, group):
        self.sent += size(obj) if group.rank else 0
        if group.rank:
            return None
        self.received += self.peer_bytes
        return [obj, *self.peers[1:]]

    def broadcast_object(self, obj, group, src=0):
        if group.rank == src:
            self.sent += size(obj)
            self.last_sent = pickle.loads(pickle.dumps(obj))  # as sent, before this rank reads on
            return obj
        self.received += size(self.sent_by_root)
        return self.sent_by_root

    def all_gather_objects(self, obj, group):  # must not be used: world x world
        self.sent += size(obj)
        self.received += size(obj) * (group.size - 1)
        return [obj] * group.size


def as_rank(layout, rank, wire):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=FakeStore())
    for name in ("gather_objects", "broadcast_object", "all_gather_objects"):
        setattr(comm, name, getattr(wire, name))
    return comm.job_group()


hashed = []
real_sha = manifest_mod.sha256_of
manifest_mod.sha256_of = lambda path: (hashed.append(Path(path).name), real_sha(path))[1]
TABLES = {manifest_mod.MANIFEST, manifest_mod.SHARDS, manifest_mod.FILES, manifest_mod.OWNED, manifest_mod.OWNED_INDEX}
table_reads = {}


class Counted:
    # A file opened by the manifest module: the bytes read from each checkpoint table.
    def __init__(self, f, name):
        self.f, self.name = f, name

    def read(self, *args):
        data = self.f.read(*args)
        if self.name in TABLES:
            table_reads[self.name] = table_reads.get(self.name, 0) + len(data)
        return data

    def __getattr__(self, key):
        return getattr(self.f, key)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


manifest_mod.open = lambda path, *args: Counted(open(path, *args), Path(path).name)
results = {}
for name, (tp, pp, dp, other) in json.loads(sys.argv[1]).items():
    layout = RankLayout(tp=tp, pp=pp, dp=dp)
    world, root = layout.world_size, Path(tempfile.mkdtemp())
    mine = {r: written(layout, r, True) for r in (0, other)}
    out, start = {"world": world}, time.perf_counter()

    wire = Wire(sent_by_root=None)  # the other rank saves; rank 0's outcome: published
    group = as_rank(layout, other, wire)
    report = write_shards(root, 1, [(t, t.tensor) for t in mine[other]], group.rank)
    publish(root, 1, report, {"model": {}}, {"tp": tp, "pp": pp, "dp": dp}, {"optimizer_step": 1}, 0, group)
    out["other_save"] = wire.sent + wire.received

    peers = [None] * world
    for r in range(1, world):
        slices = written(layout, r, False)
        peers[r] = {"bytes": 1, "sha256": "0" * 64, "shards": report_shards([(t, t.tensor) for t in slices])}
    peers[other] = report
    wire = Wire(peers=peers)
    group = as_rank(layout, 0, wire)
    own = write_shards(root, 1, [(t, t.tensor) for t in mine[0]], 0)
    t0 = time.perf_counter()
    publish(root, 1, own, {"model": {}}, {"tp": tp, "pp": pp, "dp": dp}, {"optimizer_step": 1}, 0, group)
    out["root_save_s"] = time.perf_counter() - t0
    out["root_save"] = wire.sent + wire.received
    out["shards"] = len(own["shards"]) + sum(len(r["shards"]) for r in peers[1:])
    out["tables"] = sum((root / "step_00000001" / f).stat().st_size for f in ("shards.jsonl", "files.idx"))

    wire = Wire()
    hashed.clear()
    targets = [LocalTensor(t.name, torch.zeros_like(t.tensor), t.global_shape, t.offsets, False) for t in mine[0]]
    t0 = time.perf_counter()
    directory, manifest = choose(targets, as_rank(layout, 0, wire), root=root)
    out["root_resume_s"] = time.perf_counter() - t0
    out["root_resume"], out["root_hashed"] = wire.sent + wire.received, sorted(hashed)
    pick = wire.last_sent

    wire = Wire(sent_by_root=pick)
    hashed.clear()
    table_reads.clear()
    targets = [
        LocalTensor(t.name, torch.zeros_like(t.tensor), t.global_shape, t.offsets, False, other) for t in mine[other]
    ]
    directory, manifest = choose(targets, as_rank(layout, other, wire), root=root)
    load_into(targets, directory, manifest)
    out["other_tables_read"] = dict(table_reads)
    out["other_shards"] = len(mine[other])
    out["other_resume"], out["other_hashed"] = wire.sent + wire.received, sorted(hashed)
    out["other_index_read"] = sum(manifest.tensors[t.name].at[1] for t in {t.name: t for t in targets}.values())
    out["loaded"] = manifest.step == 1 and all(torch.equal(a.tensor, b.tensor) for a, b in zip(targets, mine[other]))
    out["wall_s"] = time.perf_counter() - start
    results[name] = out
dist.destroy_process_group()
print(json.dumps(results))
"""

# Rank 0 handles at most this many bytes per shard written anywhere in the world: each rank's
# report is (name, shape, dtype, offsets, lengths) per shard it wrote (measured: 70 B per shard at
# 64 ranks, 75 at 16,384; 120 and 25.5 shards per rank), and nothing else grows with the world.
BYTES_PER_SHARD = 100
# A non-zero rank's whole share of a save's metadata round (its report and the outcome).
PER_RANK_BYTES = 8192


@pytest.fixture(scope="module")
def runs() -> dict:
    cases = {"64": (2, 4, 8, 37), "16384": (8, 16, 128, 9999)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_rank0_save_metadata_is_linear_in_world(runs):
    small, big = runs["64"], runs["16384"]
    for run in (small, big):
        assert run["root_save"] <= BYTES_PER_SHARD * run["shards"], run
    # Per rank of the world, rank 0 handles no more at 16,384 ranks than at 64 (the same model:
    # fewer layers per stage, so smaller reports): no term grows faster than the world.
    assert big["root_save"] / big["world"] <= 1.1 * small["root_save"] / small["world"], (small, big)


def test_other_ranks_send_and_receive_a_constant(runs):
    small, big = runs["64"], runs["16384"]
    assert big["other_save"] <= small["other_save"] <= PER_RANK_BYTES, (small, big)
    # The resume choice is the directory and the small manifest (O(model)), the same at any world.
    assert big["other_resume"] <= 1.1 * small["other_resume"] and big["root_resume"] <= 1.1 * small["root_resume"]
    assert big["other_resume"] < 64 * 1024, big


def test_each_rank_hashes_only_the_files_it_reads(runs):
    for case, run in runs.items():
        other = "rank09999.pt" if case == "16384" else "rank00037.pt"
        assert run["other_hashed"] == [other], run
        assert run["root_hashed"] == ["files.idx", "owned.idx", "owned.jsonl", "rank00000.pt", "shards.jsonl"], run
        assert run["loaded"], run


def test_metadata_rounds_at_16384_ranks_are_quick(runs):
    big = runs["16384"]
    assert big["root_save_s"] < 10 and big["root_resume_s"] < 5, big


# What a rank may read of the checkpoint's tables per shard it loads (measured: 62 B at 64 ranks,
# 64 at 16,384: its owned line's entries, one owned.idx and one files.idx record).
TABLE_BYTES_PER_SHARD = 120


def test_resume_reads_tables_independent_of_tp_times_dp(runs):
    """A non-zero rank resuming in the saved layout reads its own file's line of the owned table
    (and two fixed-width records): the bytes it reads of the checkpoint's tables do not grow with
    tp x dp (tp2 x dp8 at 64 ranks, tp8 x dp128 at 16,384), while one tensor's line of shards.jsonl,
    which lists every rank's piece of it, does."""
    small, big = runs["64"], runs["16384"]
    for run in (small, big):
        tables = run["other_tables_read"]
        assert set(tables) <= {"owned.idx", "owned.jsonl", "files.idx"}, tables  # no tensor lines
        assert sum(tables.values()) <= TABLE_BYTES_PER_SHARD * run["other_shards"], run
    read_small, read_big = (sum(r["other_tables_read"].values()) / r["other_shards"] for r in (small, big))
    assert read_big <= 1.1 * read_small, (read_small, read_big)
    # What reading the tensors' lines would have cost grows with tp x dp (32x here).
    assert big["other_index_read"] / big["other_shards"] > 10 * small["other_index_read"] / small["other_shards"]
