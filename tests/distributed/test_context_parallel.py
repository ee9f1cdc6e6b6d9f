"""Context parallelism through the training system: parity of every cp layout with one process,
checkpoints between cp and other layouts, the dp_cp group, and the refusals.

All runs share a few spawned groups (module fixtures): one process (references and resumes), two
ranks (cp2 ring/a2a at seq 256 and 1024, recompute, checkpoints), four ranks (cp4, cp x tp/SP,
pp, dp with ZeRO 1/3, MoE with ep). Twelve steps at a calm learning rate (harness.PARITY). The
model has 8 query and 4 kv heads (GQA) so that a2a can split them over cp 4, and over cp 2 x tp 2.
"""

import json
import subprocess
import sys

import pytest

from threefold.config import build_config
from threefold.distributed.grid import Grid, RankLayout
from threefold.errors import ConfigError
from threefold.validate import validate

from harness import CALM_LR, assert_parity, run_training, run_training_many, within

STEPS = 12
SAVED = "checkpoints/step_00000006"  # every saving run keeps its step-6 checkpoint here
BASE = {
    "train.steps": STEPS,
    "train.seed": 0,
    "train.lr": CALM_LR,
    "train.global_batch": 4,
    "train.micro_batch": 2,
    "model.seq_len": 256,
    "model.layers": 2,
    "model.heads": 8,
    "model.kv_heads": 4,
    "checkpoint.dir": "",
}
SAVE = {"checkpoint.dir": "auto", "checkpoint.interval": 6}
LONG = {"model.seq_len": 1024, "train.global_batch": 2, "train.micro_batch": 1}
MOE = {"model.num_experts": 4, "model.top_k": 2}
# Learned positions (GPT-2's table takes global positions too) and held-out evaluation, briefly.
GPT2_EVAL = {"model.arch": "gpt2", "model.kv_heads": 8, "train.steps": 4, "train.eval_every": 2}
GPT2_EVAL.update({"data.val_fraction": 0.05, "train.eval_sequences": 4})
DROPOUT = {"model.dropout": 0.1, "train.steps": 4}
CP2 = {"parallel.cp": 2}

TWO = {
    "cp2-ring": {**CP2, **SAVE, "log.trace_steps": "3"},
    "cp2-a2a": {**CP2, "parallel.cp_impl": "a2a", "log.trace_steps": "3"},
    "cp2-ring-1024": {**CP2, **LONG},
    "cp2-full-recompute": {**CP2, "train.recompute": "full"},
    "cp2-selective-recompute": {**CP2, "train.recompute": "selective", "parallel.cp_impl": "a2a"},
}
FOUR = {
    "cp4-ring": {"parallel.cp": 4},
    "cp4-a2a": {"parallel.cp": 4, "parallel.cp_impl": "a2a"},
    "cp2-tp2-sp": {**CP2, "parallel.tp": 2, "parallel.sp": True},
    "cp2-tp2-sp-a2a": {**CP2, "parallel.tp": 2, "parallel.sp": True, "parallel.cp_impl": "a2a"},
    "cp2-pp2": {**CP2, "parallel.pp": 2},
    "cp2-dp2-zero1": {**CP2, "parallel.dp": 2, "parallel.zero": 1},
    "cp2-dp2-zero3": {**CP2, "parallel.dp": 2, "parallel.zero": 3, **SAVE},
    "moe-cp2-dp2-ep2": {**CP2, **MOE, "parallel.dp": 2, "parallel.ep": 2},
    "moe-cp2-tp2": {**CP2, **MOE, "parallel.tp": 2},
}


@pytest.fixture(scope="module")
def one(tmp_path_factory, cache_dir) -> dict:
    root = tmp_path_factory.mktemp("one")
    runs = {"dense": {**BASE, **SAVE}, "dense-1024": {**BASE, **LONG}, "moe": {**BASE, **MOE}}
    runs["gpt2-eval"] = {**BASE, **GPT2_EVAL}
    out = {name: run_training(over, root / name, cache_dir) for name, over in runs.items()}
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory, cache_dir, one) -> dict:
    root = tmp_path_factory.mktemp("two")
    runs = {name: {**BASE, **over} for name, over in TWO.items()}
    runs["cp2-gpt2-eval"] = {**BASE, **CP2, **GPT2_EVAL}
    for mode in ("none", "selective", "full"):  # dropout: the recomputed masks are the first ones
        runs[f"cp2-dropout-{mode}"] = {**BASE, **CP2, **DROPOUT, "train.recompute": mode}
    # Resumes, after the runs that saved: one process's checkpoint into cp 2, cp 2's into tp 2.
    runs["cp1-ckpt-into-cp2"] = {**BASE, **CP2, "checkpoint.resume": one["root"] / "dense" / SAVED}
    runs["cp2-ckpt-into-tp2"] = {**BASE, "parallel.tp": 2, "checkpoint.resume": root / "cp2-ring" / SAVED}
    out = run_training_many(runs, root, cache_dir, world=2, timeout=600)
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory, cache_dir) -> dict:
    root = tmp_path_factory.mktemp("four")
    out = run_training_many({name: {**BASE, **over} for name, over in FOUR.items()}, root, cache_dir, world=4)
    out["root"] = root
    return out


def _reference(name: str, one: dict) -> list[dict]:
    return one["moe" if name.startswith("moe") else "dense-1024" if name.endswith("1024") else "dense"]


def _same_training(name: str, ref: list[dict], run: list[dict]) -> None:
    """The same losses, gradient norms (relative 1e-5: a gradient summed over dp only, or scaled
    by cp, shows here even where AdamW's scale invariance hides it in the loss) and tokens."""
    assert [r["step"] for r in run] == list(range(1, STEPS + 1))
    assert_parity(f"{name} vs one process loss", ref, run)
    norms = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(run, ref))
    within(f"{name} vs one process relative grad norm", norms, 1e-5)
    assert [r["tokens"] for r in run] == [r["tokens"] for r in ref]  # every token counted once


@pytest.mark.parametrize("name", list(TWO))
def test_two_rank_cp_layout_matches_one_process(name, two, one):
    run, ref = two[name], _reference(name, one)
    _same_training(name, ref, run)
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.3  # a run that learns, not a flat line


@pytest.mark.parametrize("name", list(FOUR))
def test_four_rank_cp_layout_matches_one_process(name, four, one):
    run, ref = four[name], _reference(name, one)
    _same_training(name, ref, run)
    assert not any(r["step_skipped"] for r in run)
    if name.startswith("moe"):  # every token went where one process's router sent it
        assert run[-1]["moe_expert_tokens"] == ref[-1]["moe_expert_tokens"]


def test_learned_positions_and_heldout_evaluation_under_cp(two, one):
    ref, run = one["gpt2-eval"], two["cp2-gpt2-eval"]
    assert_parity("gpt2 cp2 vs one process loss", ref, run)
    evals = [(a["val_loss"], b["val_loss"]) for a, b in zip(ref, run) if "val_loss" in a]
    assert len(evals) == 2 and all("val_loss" in b for a, b in zip(ref, run) if "val_loss" in a)
    within("gpt2 cp2 vs one process held-out loss", max(abs(a - b) for a, b in evals), 1e-5)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_under_cp_reproduces_dropout_exactly(mode, two):
    plain, rerun = two["cp2-dropout-none"], two[f"cp2-dropout-{mode}"]
    assert len(plain) == 4 and [r["loss"] for r in rerun] == [r["loss"] for r in plain]


@pytest.mark.parametrize("name", ["cp1-ckpt-into-cp2", "cp2-ckpt-into-tp2"])
def test_checkpoint_moves_between_cp_and_other_layouts(name, two, one):
    resumed = two[name]
    assert [r["step"] for r in resumed] == list(range(7, STEPS + 1))
    assert_parity(f"{name} loss", one["dense"][6:], resumed)


@pytest.mark.parametrize("source", ["two/cp2-ring", "four/cp2-dp2-zero3"])
def test_one_process_resumes_a_cp_checkpoint(source, two, four, one, tmp_path, cache_dir):
    group, name = source.split("/")
    saved = {"two": two, "four": four}[group]["root"] / name / SAVED
    resumed = run_training({**BASE, "checkpoint.resume": saved}, tmp_path, cache_dir)
    assert [r["step"] for r in resumed] == list(range(7, STEPS + 1))
    assert_parity(f"{source} checkpoint into one process, loss", one["dense"][6:], resumed)


def test_traced_steps_measure_how_much_of_the_ring_is_hidden(two, capsys):
    """On a traced step the ring's exchanges are replayed alone after the step: their cost and
    the fraction of it the step did not wait for reach metrics.jsonl and the report; a2a posts
    no point-to-point exchange, so it has no such figure."""
    from threefold.cli import main

    traced = [r for r in two["cp2-ring"] if "cp_hidden" in r]
    assert [r["step"] for r in traced] == [3]
    hidden, alone = traced[0]["cp_hidden"], traced[0]["cp_comm_serial_s"]
    assert alone > 0 and 0 <= hidden["min"] <= hidden["mean"] <= 1
    # One host: the waits for a slower peer set aside, which can only shrink the exposed wait
    # (up to the few microseconds by which a wait's own clock reads exceed its spans').
    own = traced[0]["cp_hidden_own"]
    assert 0 <= own["min"] <= own["mean"] <= 1 and own["mean"] >= hidden["mean"] - 0.02, (own, hidden)
    assert traced[0]["time_s"]["max"]["cp_comm"] > 0  # the exposed part it is compared with
    assert not any("cp_hidden" in r for r in two["cp2-a2a"])
    assert main(["report", str(two["root"] / "cp2-ring")]) == 0
    assert "cp ring exchanges" in capsys.readouterr().out


def test_dp_cp_group_spans_dp_and_cp_and_is_dp_without_cp():
    lay = RankLayout(tp=2, cp=2, dp=2)
    groups = lay.group_lists()
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # same tp rank: the replicas of a weight
    assert groups["expert_dp"] == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert RankLayout(tp=2, dp=2).group_lists()["dp_cp"] == RankLayout(tp=2, dp=2).group_lists()["dp"]
    grid = Grid.alone()
    assert grid.dp_cp is grid.dp


def _refusal(overrides: dict, world: int | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        validate(build_config(None, [(k, str(v)) for k, v in overrides.items()]), world)
    line = str(err.value)
    assert "\n" not in line
    return line


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        ({"parallel.cp": 3, "model.seq_len": 128}, "model.seq_len", "2*parallel.cp"),
        ({"parallel.cp": 2, "model.seq_len": 36, "parallel.tp": 4, "parallel.sp": True}, "parallel.sp", "seq_len/cp"),
        ({"parallel.cp": 4, "parallel.cp_impl": "a2a"}, "parallel.cp", "model.kv_heads/tp (2)"),
        ({"parallel.cp": 2, "parallel.cp_impl": "a2a", "parallel.tp": 4}, "parallel.cp", "heads/tp (1)"),
        ({"parallel.cp": 2, "data.document_mask": True}, "data.document_mask", "context parallelism"),
        ({"parallel.cp": 2, "model.arch": "own_model_gptj:build"}, "parallel.cp", "user model"),
        (
            {"parallel.cp": 2, "model.seq_len": 36, "parallel.tp": 4, "model.num_experts": 2},
            "parallel.tp",
            "MoE",
        ),
        ({"parallel.cp": 2, "model.num_experts": 2, "model.capacity_factor": 1.0}, "model.capacity_factor", "dropless"),
        ({"parallel.cp": 2, "parallel.cp_impl": "zigzag"}, "parallel.cp_impl", "ring, a2a"),
    ],
)
def test_what_cp_cannot_serve_is_refused_in_one_line(overrides, key, words):
    line = _refusal({"model.preset": "tiny", **overrides})
    assert line.startswith(key) and words in line, line


def test_world_size_counts_cp():
    line = _refusal({"model.preset": "tiny", "parallel.cp": 2, "parallel.dp": 2}, world=2)
    assert "dp*tp*pp*cp" in line, line


def test_planner_knows_cp_memory_and_layout_text():
    from threefold.planner import Layout, device_memory, layer_activation_bytes, model_shape
    from threefold.planner.layout import parse_layout

    lay = parse_layout("tp=2,cp=4,zero=1", 64)
    assert (lay.dp, lay.world) == (8, 64) and parse_layout(lay.spec(), 64) == lay
    assert "cp=" not in Layout(tp=2).spec()  # layouts without cp print as before
    shape = model_shape(build_config(None, [("model.preset", "small"), ("model.seq_len", "4096")]).model)
    one, four = (device_memory(shape, Layout(dp=2, cp=cp, zero=1), global_batch=8) for cp in (1, 4))
    # Activations: the per-layer formula at seq/cp; the dense state sharded over dp x cp by ZeRO.
    s, h = 4096 // 4, shape.hidden
    head = (4 * s * h + 2 * s * shape.vocab) * 2 / 2  # the last rank's norm/head inputs and logits, bf16
    assert four.activations == pytest.approx(shape.layers * layer_activation_bytes(s, 1, h, shape.heads) + head)
    assert four.activations < 0.3 * one.activations
    assert four.optimizer == pytest.approx(device_memory(shape, Layout(dp=8, zero=1), 8).optimizer)


def test_memory_command_measures_cp_activations_at_1_over_cp(cache_dir):
    """`threefold memory` at cp 1 and cp 2 (ZeRO 1 over dp_cp): activations per rank halve and
    match the formula at seq/cp; model state is ZeRO's formula with N = dp x cp."""
    rows = {}
    for cp in (1, 2):
        args = [
            "--model.seq_len",
            "1024",
            "--model.layers",
            "2",
            "--train.global_batch",
            "1",
            "--train.micro_batch",
            "1",
        ]
        args += ["--parallel.cp", str(cp), "--parallel.zero", "1", "--data.cache_dir", cache_dir, "--json"]
        out = subprocess.run(
            [sys.executable, "-m", "threefold", "memory", *args], capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        rows[cp] = json.loads(out.stdout)
    assert [r["cp"] for r in rows[2]] == [0, 1]
    for r in rows[1] + rows[2]:
        meas, pred = r["measured"], r["predicted"]
        for c in ("params", "grads", "optimizer"):
            within(f"cp rank {r['rank']} {c} measured / predicted - 1", abs(meas[c] / pred[c] - 1), 0)
        within("activations measured / predicted - 1", abs(meas["activations"] / pred["activations"] - 1), 0.15)
    assert rows[2][0]["measured"]["optimizer"] == rows[2][0]["measured"]["params"]  # fp32 8P / N=2
    ratio = rows[2][0]["measured"]["activations"] / rows[1][0]["measured"]["activations"]
    within("cp 2 / cp 1 measured activations", ratio, 0.55)
