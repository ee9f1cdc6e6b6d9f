"""Asynchronous checkpoint snapshots (checkpoint/io.py HostSnapshot, checkpoint/writer.py): host
buffers allocated once and reused from save to save, holding the values of the step saved even
when the next update comes before the file is written, and the same tensors a synchronous save
writes."""

from __future__ import annotations

import threading

import torch

import threefold.checkpoint.writer as writer
from threefold.checkpoint import LocalTensor, load_into, open_checkpoint
from threefold.checkpoint.writer import Checkpointer
from threefold.distributed import comm

SELF = comm.Group("self", [0], None)  # one process: the metadata round needs no process group


def _engine_like_state() -> tuple[list[torch.Tensor], list[LocalTensor]]:
    """Slices of flat buffers, as the data-parallel engine hands its master weights and moments
    to a checkpoint (views, one of them a tensor this rank does not write)."""
    gen = torch.Generator().manual_seed(0)
    flats = [torch.randn(100, generator=gen), torch.randn(64, generator=gen)]
    state = [
        LocalTensor("model/w", flats[0][:60].view(6, 10), (12, 10), (6, 0), True),
        LocalTensor("model/b", flats[0][60:90], (30,), (0,), True),
        LocalTensor("model/tied_copy", flats[0][90:], (10,), (0,), False),
        LocalTensor("optim/exp_avg/w", flats[1].view(8, 8)[:, 2:6], (8, 4), (0, 0), True),  # strided
    ]
    return flats, state


def _saved(root, state: list[LocalTensor]) -> dict[str, torch.Tensor]:
    """The slices `state` writes, read back from the newest checkpoint under `root` through the
    package (open_checkpoint verifies every file)."""
    directory, manifest = open_checkpoint(root)
    slices = [
        LocalTensor(t.name, torch.full_like(t.tensor, float("nan")), t.global_shape, t.offsets, False)
        for t in state
        if t.write
    ]
    load_into(slices, directory, manifest)
    return {t.name: t.tensor for t in slices}


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def test_async_snapshot_reuses_its_buffers_and_keeps_the_saved_step(tmp_path, monkeypatch):
    flats, state = _engine_like_state()
    handed, gate, write = [], threading.Event(), writer.write_shards

    def held_write(root, step, shards, rank):  # the background write waits for the test's update
        handed.append([host for _, host in shards])  # kept alive: a fresh allocation cannot reuse them
        gate.wait(timeout=60)
        return write(root, step, shards, rank)

    monkeypatch.setattr(writer, "write_shards", held_write)
    before = {t.name: t.tensor.clone() for t in state}
    ckpt = Checkpointer(str(tmp_path / "async"), state, {}, {}, 0, asynchronous=True, group=SELF)
    ckpt.save(1, {})
    for flat in flats:  # the next optimizer step, before the file of step 1 is written
        flat.mul_(-2.0).add_(1.0)
    gate.set()
    ckpt.wait()
    step1 = _saved(tmp_path / "async", state)
    assert _bitwise_equal(step1, {n: t for n, t in before.items() if n != "model/tied_copy"}), "not the saved step"

    ckpt.save(2, {})
    ckpt.close()
    first, second = ([t.untyped_storage().data_ptr() for t in hosts] for hosts in handed)
    assert first == second, "a new host allocation per save"
    assert not any(t.is_pinned() for t in handed[0])  # CPU tensors: plain memory (pinning needs an accelerator)

    Checkpointer(str(tmp_path / "sync"), state, {}, {}, 0, asynchronous=False, group=SELF).save(2, {})
    assert _bitwise_equal(_saved(tmp_path / "async", state), _saved(tmp_path / "sync", state))
    after = {t.name: t.tensor for t in state if t.write}
    assert _bitwise_equal(_saved(tmp_path / "sync", state), after)  # and step 2 is the updated state


def test_new_shapes_get_new_buffers(tmp_path):
    """A state whose shapes changed (another layout after a restart) is not copied into the old
    buffers; the same shapes keep them."""
    from threefold.checkpoint.io import HostSnapshot

    host = HostSnapshot()
    a = [LocalTensor("model/w", torch.ones(4, 3), (4, 3), (0, 0), True)]
    kept = host.take(a)[0][1].untyped_storage().data_ptr()
    assert host.take(a)[0][1].untyped_storage().data_ptr() == kept
    b = [LocalTensor("model/w", torch.full((2, 3), 5.0), (4, 3), (2, 0), True)]
    ((_, buffer),) = host.take(b)
    assert buffer.shape == (2, 3) and torch.equal(buffer, b[0].tensor)
