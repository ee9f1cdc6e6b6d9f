"""Checkpoints: exact resume, resharding between layouts, crash safety, corruption, bad input."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from threefold.checkpoint import CheckpointError, find_resumable, list_checkpoints, open_checkpoint

from harness import CALM_LR, assert_parity, run_ranks, run_training, run_training_many

BASE = {"train.steps": 10, "train.seed": 0, "train.lr": CALM_LR}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir):
    return run_training(BASE, tmp_path_factory.mktemp("straight"), cache_dir)


def _keep_only_step5(ckpt):
    shutil.rmtree(ckpt / "step_00000010")
    (ckpt / "latest").write_text("step_00000005\n")


def test_resume_is_bitwise_exact(straight, tmp_path, cache_dir):
    ckpt = tmp_path / "ckpt"
    first = run_training({**BASE, "checkpoint.dir": ckpt, "checkpoint.interval": 5}, tmp_path / "a", cache_dir)
    assert [r["loss"] for r in first] == [r["loss"] for r in straight]
    _keep_only_step5(ckpt)
    resumed = run_training({**BASE, "checkpoint.dir": ckpt, "checkpoint.resume": "auto"}, tmp_path / "b", cache_dir)
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[5:]]


@pytest.fixture(scope="module")
def saved_layouts(tmp_path_factory, cache_dir):
    """Step-5 checkpoints written by three 4-rank layouts."""
    root = tmp_path_factory.mktemp("layouts")
    layouts = {
        "tp2-pp2": {"parallel.tp": 2, "parallel.pp": 2},
        "dp4": {"parallel.dp": 4},
        "tp2-dp2-zero2": {"parallel.tp": 2, "parallel.dp": 2, "parallel.sp": "true", "parallel.zero": 2},
    }
    runs = {
        name: {**BASE, **over, "train.steps": 5, "checkpoint.dir": root / name / "ckpt"}
        for name, over in layouts.items()
    }
    run_training_many(runs, root, cache_dir, world=4)
    return {name: root / name / "ckpt" for name in layouts}


@pytest.mark.parametrize(
    "source, target",
    [
        ("tp2-pp2", {"parallel.dp": 4}),
        ("dp4", {"parallel.tp": 2, "parallel.dp": 2, "parallel.sp": "true", "parallel.zero": 2}),
        ("tp2-dp2-zero2", {"parallel.tp": 2, "parallel.pp": 2}),
        ("tp2-pp2", {"parallel.dp": 4, "parallel.zero": 3}),
    ],
)
def test_checkpoint_loads_into_another_layout(source, target, saved_layouts, straight, tmp_path, cache_dir):
    runs = {"resumed": {**BASE, **target, "checkpoint.resume": saved_layouts[source]}}
    resumed = run_training_many(runs, tmp_path, cache_dir, world=4)["resumed"]
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert_parity(f"{source} checkpoint into {target}, loss", straight[5:], resumed)


def test_one_process_loads_a_four_rank_checkpoint(saved_layouts, straight, tmp_path, cache_dir):
    resumed = run_training({**BASE, "checkpoint.resume": saved_layouts["tp2-pp2"]}, tmp_path, cache_dir)
    assert_parity("4-rank checkpoint into one process, loss", straight[5:], resumed)


def test_init_from_takes_the_weights_and_starts_a_fresh_run(saved_layouts, straight, tmp_path, cache_dir):
    run = run_training(
        {**BASE, "train.steps": 2, "checkpoint.init_from": saved_layouts["tp2-pp2"]}, tmp_path, cache_dir
    )
    assert [r["step"] for r in run] == [1, 2]  # step, LR warm-up and data order start anew
    assert run[0]["loss"] < straight[0]["loss"] - 0.3  # but from the trained weights
    assert run[0]["lr"] == straight[0]["lr"]


def test_crash_during_save_leaves_previous_checkpoint(saved_layouts, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_layouts["dp4"], ckpt)
    # A save that died half-way: its temporary directory exists, without a manifest.
    partial = ckpt / "step_00000009.tmp"
    partial.mkdir()
    (partial / "rank00000.pt").write_bytes(b"half a file")
    directory, manifest = find_resumable(ckpt)
    assert directory.name == "step_00000005" and manifest.step == 5
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_00000005"]


def test_corrupted_shard_is_reported_and_the_previous_used(saved_layouts, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_layouts["dp4"] / "step_00000005", ckpt / "step_00000005")
    shutil.copytree(saved_layouts["dp4"] / "step_00000005", ckpt / "step_00000007")
    manifest = json.loads((ckpt / "step_00000007" / "manifest.json").read_text())
    manifest["step"] = 7
    (ckpt / "step_00000007" / "manifest.json").write_text(json.dumps(manifest))
    shard = ckpt / "step_00000007" / "rank00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    warnings = []
    directory, found = find_resumable(ckpt, warn=warnings.append)
    assert directory.name == "step_00000005"
    assert len(warnings) == 1 and "checksum mismatch" in warnings[0] and "step_00000007" in warnings[0]
    (ckpt / "step_00000005" / "rank00000.pt").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        open_checkpoint(ckpt / "step_00000005")


def _cli(args, cache_dir):
    return subprocess.run(
        [sys.executable, "-m", "threefold", "train", "--data.cache_dir", cache_dir, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_not_a_checkpoint_is_one_line_and_touches_nothing(tmp_path, cache_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _cli(["--checkpoint.resume", str(empty), "--log.dir", str(tmp_path / "run")], cache_dir)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "neither a checkpoint" in out.stderr and list(empty.iterdir()) == []


def test_checkpoint_of_another_model_shape_is_one_line(saved_layouts, tmp_path, cache_dir):
    before = sorted(p.name for p in saved_layouts["dp4"].iterdir())
    out = _cli(
        ["--checkpoint.resume", str(saved_layouts["dp4"]), "--model.hidden", "256", "--log.dir", str(tmp_path / "run")],
        cache_dir,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "has shape" in out.stderr
    assert sorted(p.name for p in saved_layouts["dp4"].iterdir()) == before


def test_info_and_export(saved_layouts, tmp_path):
    info = subprocess.run(
        [sys.executable, "-m", "threefold", "checkpoint", "info", str(saved_layouts["tp2-pp2"])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert info.returncode == 0, info.stderr
    assert "step        5" in info.stdout and "tp=2 pp=2 dp=1" in info.stdout and "verified" in info.stdout
    safetensors = pytest.importorskip("safetensors.torch")
    out = tmp_path / "export"
    done = subprocess.run(
        [sys.executable, "-m", "threefold", "checkpoint", "export", str(saved_layouts["tp2-pp2"]), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    weights = safetensors.load_file(str(out / "model.safetensors"))
    assert weights["tok_embed.weight"].shape == (256, 128) and weights["layers.3.mlp.w2.weight"].shape == (128, 352)


def _choice_worker(root: str) -> dict:
    """Two ranks save steps 1 and 2, then resume three ways (see the test below)."""
    import torch

    import threefold.checkpoint.resume as resume
    from threefold.checkpoint import LocalTensor, choose, load_into, save
    from threefold.distributed import comm
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=60)
    group = comm.job_group()
    rank, w, out = group.rank, torch.zeros(4), {}
    state = [LocalTensor("model/w", w, (8,), (4 * rank,), True)]
    for step in (1, 2):
        w.fill_(10 * step + rank)
        save(root, step, state, {}, {}, {"optimizer_step": step}, group=group)
    if rank == 1:  # this rank's listing lags behind (a stale directory cache): only step 1
        resume.list_checkpoints = lambda r: [Path(r) / "step_00000001"]
    w.zero_()
    directory, manifest = choose(state, group, root=root)
    load_into(state, directory, manifest)
    out["lagging listing"] = [manifest.step, w.tolist()]
    if rank == 1:  # only rank 1 reads its file: rank 0 alone would not see the corruption
        shard = Path(root) / "step_00000002" / "rank00001.pt"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    comm.barrier(group)
    warnings: list[str] = []
    out["corrupt"] = [choose(state, group, root=root, warn=warnings.append)[1].step, warnings]
    try:
        choose(state, group, path=Path(root) / "step_00000002")
        out["named"] = None
    except CheckpointError as err:
        out["named"] = str(err)
    shutdown_distributed()
    return out


def test_every_rank_resumes_from_rank0s_choice_and_fails_alike(tmp_path):
    """A rank whose own listing lags still loads the step rank 0 chose; a file only rank 1
    reads is corrupted: both skip that checkpoint (auto) or raise the same line (named)."""
    outs = run_ranks(_choice_worker, 2, str(tmp_path), timeout=120)
    assert [o["lagging listing"] for o in outs] == [[2, [20.0] * 4], [2, [21.0] * 4]]
    for o in outs:
        step, warnings = o["corrupt"]
        assert step == 1 and len(warnings) == 1, o
        assert "skipping checkpoint step_00000002" in warnings[0] and "rank00001.pt: checksum mismatch" in warnings[0]
    assert outs[0]["named"] == outs[1]["named"] and "rank00001.pt: checksum mismatch" in outs[0]["named"], outs


OWN_LINE_LAYOUTS = {  # name: (RankLayout kwargs, config)
    "tp2-dp2-zero0": ({"tp": 2, "dp": 2}, {"parallel.tp": 2, "parallel.dp": 2}),
    "pp2-dp2-zero1-tied": (
        {"pp": 2, "dp": 2},
        {"parallel.pp": 2, "parallel.dp": 2, "parallel.zero": 1, "model.tie_embeddings": "true"},
    ),
}


def _own_lines_worker(data: str, root: str) -> dict:
    """Per layout: a Trainer saves step 2; this rank then chooses and loads that checkpoint into
    zeroed copies of its slices. What it read of shards.jsonl (tensor lines: every rank's piece)
    and whether every slice came back."""
    import torch

    import threefold.checkpoint.manifest as manifest_mod
    from threefold.checkpoint import LocalTensor, choose, load_into
    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.runtime import init_distributed, shutdown_distributed
    from threefold.training.trainer import Trainer

    from dp_checks import CPU, make_cfg

    init_distributed(CPU, timeout_s=120)
    tensor_lines: list[str] = []
    real = manifest_mod.Manifest.read_shards

    def read_shards(self, directory, names):
        tensor_lines.extend(n for n in set(names) if n in self.tensors and self.tensors[n].shards is None)
        return real(self, directory, names)

    manifest_mod.Manifest.read_shards = read_shards
    out = {}
    for name, (layout, extra) in OWN_LINE_LAYOUTS.items():
        ckpt = f"{root}/{name}"
        cfg = make_cfg(data, **{**extra, "train.steps": 2, "checkpoint.dir": ckpt, "checkpoint.interval": 2})
        grid = Grid.build(RankLayout(**layout))
        trainer = Trainer(cfg, grid, CPU, log=lambda *args: None)
        for step in range(2):
            trainer.train_step(step)
        trainer.guard.ckpt.save(2, {"optimizer_step": 2})
        trainer.guard.close()
        copies = [
            LocalTensor(t.name, torch.zeros_like(t.tensor), t.global_shape, t.offsets, False, t.source)
            for t in trainer.state
        ]
        tensor_lines.clear()
        directory, manifest = choose(copies, grid.world, root=ckpt)
        load_into(copies, directory, manifest)
        out[name] = {
            "step": manifest.step,
            "tensor_lines": sorted(set(tensor_lines)),
            "loaded": all(torch.equal(c.tensor, t.tensor) for c, t in zip(copies, trainer.state)),
            "replicas": sum(not t.write for t in trainer.state),
        }
    shutdown_distributed()
    return out


def test_resume_in_the_saved_layout_reads_only_owned_lines(data, tmp_path):
    """Resuming in the layout it saved with, every rank finds its slices in the owned lines of the
    files that hold them: its own, or the replica's that wrote them (ZeRO 0's dp rank 0, TP rank 0
    for the norms every TP rank holds, the first stage for the last stage's tied embedding) and
    reads no tensor line of shards.jsonl; the slices load exactly."""
    outs = run_ranks(_own_lines_worker, 4, data, str(tmp_path), timeout=300)
    for rank, out in enumerate(outs):
        for name, r in out.items():
            assert r["step"] == 2 and r["loaded"] and r["tensor_lines"] == [], (rank, name, r)
    assert any(r["replicas"] for out in outs for r in out.values())  # slices written by another rank
