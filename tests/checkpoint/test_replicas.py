"""Memory replicas without processes (checkpoint/replicas.py, replica_store.py): who keeps a copy
of whom, and a replica that is a checkpoint of the storage format (written in place into a
mapped file, checksummed, loaded back bit for bit, a flipped byte refused)."""

from __future__ import annotations

import pytest
import torch

from threefold.checkpoint import CheckpointError, LocalTensor, load_into, verify
from threefold.checkpoint.manifest import Manifest
from threefold.checkpoint.replica_store import DATA, MappedState, NodeStore, invalidate, publish, report_of
from threefold.checkpoint.replicas import plan_buddies, whole_state
from threefold.distributed.grid import RankLayout


def _twins(layout: RankLayout, zero: int):
    return (lambda r: layout.group_of(r, ("ep", "dp", "cp"))) if zero == 0 else (lambda r: [r])


def _plans(world: int, per_node: int, twins_of, copies: int = 1):
    return [plan_buddies(r, world, per_node, twins_of, copies) for r in range(world)]


def _holders(plans, per_node: int) -> dict[int, set[int]]:
    """Nodes holding each rank's state: its own, its twins', the buddy it sends to."""
    out = {}
    for r, p in enumerate(plans):
        nodes = {t // per_node for t in p.twins}
        for twin in p.twins:
            if plans[twin].send_to is not None:
                nodes.add(plans[twin].send_to // per_node)
        out[r] = nodes
    return out


@pytest.mark.parametrize(
    "layout,zero,per_node",
    [
        (RankLayout(dp=2, pp=2), 0, 2),  # dp twins on one node: explicit copies
        (RankLayout(dp=2, pp=2, order="tp-cp-ep-pp-dp"), 0, 2),  # dp twins on two nodes: none sent
        (RankLayout(dp=2, pp=2), 1, 2),  # ZeRO 1: no twins
        (RankLayout(tp=2, pp=2), 0, 2),
        (RankLayout(dp=4, pp=2), 2, 4),
        (RankLayout(dp=3), 1, 2),  # nodes unevenly filled
    ],
)
def test_every_state_is_held_on_two_nodes_and_sends_are_one_per_rank(layout, zero, per_node):
    world = layout.world_size
    plans = _plans(world, per_node, _twins(layout, zero))
    assert all(len(nodes) >= 2 for nodes in _holders(plans, per_node).values())
    for r, p in enumerate(plans):
        if p.send_to is not None:
            assert p.send_to // per_node != r // per_node  # never the sender's own node
            assert r in plans[p.send_to].receive_from  # both ends agree on the pair
        assert all(plans[s].send_to == r for s in p.receive_from)
    # Per-rank cost does not grow with the world: one send, at most two receives.
    assert all(len(p.receive_from) <= 2 for p in plans)


def test_dp_twins_on_other_nodes_replace_the_transfer():
    """ZeRO 0, dp across nodes: each state already lives on two nodes, nothing is sent."""
    layout = RankLayout(dp=2, pp=2, order="tp-cp-ep-pp-dp")
    plans = _plans(4, 2, _twins(layout, 0))
    assert [p.send_to for p in plans] == [None] * 4 and all("dp twins" in p.note for p in plans)
    # The same layout with dp inside a node: the lowest twin of each node sends one copy.
    plans = _plans(4, 2, _twins(RankLayout(dp=2, pp=2), 0))
    assert [p.send_to for p in plans] == [2, None, 0, None]


def test_one_node_or_no_copies_send_nothing():
    for per_node, copies in ((4, 1), (2, 0)):
        plans = _plans(4, per_node, lambda r: [r], copies)
        assert all(p.send_to is None and not p.receive_from for p in plans)


def _state() -> list[LocalTensor]:
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(200, generator=gen)
    return [
        LocalTensor("model/w", flat[:60].view(6, 10), (12, 10), (6, 0), True),
        LocalTensor("optim/exp_avg/w", flat[60:120].view(6, 10), (12, 10), (6, 0), True),
        LocalTensor("model/norm", flat[120:130], (10,), (0,), False, dp_replica=True),  # a dp replica's slice
        LocalTensor("model/norm", flat[120:130], (10,), (0,), False),  # the same slice again
        LocalTensor("model/b", flat[130:160].to(torch.bfloat16), (30,), (0,), True),
    ]


def _snapshot(directory, state):
    tensors = whole_state(state)
    mapped = MappedState(directory, tensors)
    for buffer, t in zip(mapped.buffers, tensors):
        buffer.copy_(t.tensor)
    publish(directory, 7, {}, {"world_size": 1}, {"optimizer_step": 7}, report_of(directory, tensors, mapped.buffers))
    return tensors, mapped


def test_a_replica_is_a_checkpoint_written_in_place_that_loads_bit_for_bit(tmp_path):
    store = NodeStore(tmp_path / "node")
    state = _state()
    directory = store.free_slot(0)
    tensors, mapped = _snapshot(directory, state)
    assert len(tensors) == 4  # the repeated slice once
    manifest = Manifest.read(directory)
    verify(directory, manifest)  # sizes and sha256, as for a storage checkpoint
    back = [LocalTensor(t.name, torch.full_like(t.tensor, -1.0), t.global_shape, t.offsets, False) for t in tensors]
    load_into(back, directory, manifest)
    assert all(torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8)) for a, b in zip(back, tensors))
    # The mapping is the file: a new copy lands in the same pages, no new file is written.
    inode = (directory / DATA).stat().st_ino
    state[0].tensor.add_(1.0)
    mapped.buffers[0].copy_(state[0].tensor)
    assert (directory / DATA).stat().st_ino == inode
    assert torch.equal(torch.load(directory / DATA, weights_only=True)["model/w@6,0"], state[0].tensor)
    # The other slot is the one overwritten next; an unpublished slot is not a replica.
    assert store.free_slot(0) != directory
    invalidate(directory)
    assert store.replicas() == [] and store.free_slot(0) == directory


def test_a_flipped_byte_in_a_replica_is_refused(tmp_path):
    directory = NodeStore(tmp_path / "node").free_slot(3)
    _snapshot(directory, _state())
    data = bytearray((directory / DATA).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (directory / DATA).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        verify(directory, Manifest.read(directory))


def test_the_store_lists_published_replicas_newest_first_and_wipes(tmp_path):
    store = NodeStore(tmp_path / "node")
    _snapshot(store.slot(1, 0), _state())
    found = store.replicas()
    assert [(r.producer, r.step) for r in found] == [(1, 7)]
    store.wipe()
    assert not store.dir.exists() and store.replicas() == []
    with pytest.raises(OSError):  # a wiped store is not recreated by a late writer
        MappedState(store.slot(1, 1), whole_state(_state()))


def test_the_store_is_the_machines_whatever_ranks_it_runs():
    """A survivor given other ranks after a replacement node joined finds its store: named by
    the agent and the node's index among its workers, not by the global rank."""
    from threefold.checkpoint.replicas import store_dir
    from threefold.config import build_config
    from threefold.distributed.runtime import WorkerEnv

    cfg = build_config(None, [("parallel.dp", "2"), ("parallel.pp", "2")])
    before, after = WorkerEnv(0, 4, 0, 2, 0), WorkerEnv(2, 4, 0, 2, 1)  # local rank 0, global 0 then 2
    assert store_dir(cfg, before) == store_dir(cfg, after)
    assert store_dir(cfg, WorkerEnv(1, 4, 1, 2, 0)) == store_dir(cfg, before)  # one node per agent
    cfg.parallel.devices_per_node = 1  # one agent's workers as two nodes
    assert store_dir(cfg, WorkerEnv(1, 4, 1, 2, 0)) != store_dir(cfg, WorkerEnv(0, 4, 0, 2, 0))
