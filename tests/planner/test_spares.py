"""Hot spares (planner/spares.py, planner/faults.py): the chance a failure finds no spare, what a
failure then costs, and the count that maximises throughput x goodput, on a cluster small enough
to check by hand."""

from __future__ import annotations

import json
import math

import pytest
from planner_helpers import model, plan_cli

from threefold.planner import build_cluster, model_shape
from threefold.planner.faults import Faults, goodput, no_spare_probability, recovery_s, young_interval
from threefold.planner.spares import best_option, candidates, spare_options

SHAPE = model_shape(model([("model.preset", "llama-7b")]))
PINS = {"tp": 8, "pp": 1, "zero": 1, "recompute": "none"}


def test_the_chance_no_spare_is_free_and_what_a_failure_then_costs():
    # 10 nodes of 8 GPUs at 100 h per GPU: a node fails every 12.5 h and is out 1 h, so 0.8
    # nodes are out on average (Poisson): no spare free with 0, 1, 2 spares: 1, 1 - e^-0.8,
    # 1 - 1.8 e^-0.8.
    assert no_spare_probability(0, 10, 12.5, 1.0) == 1.0
    assert no_spare_probability(1, 10, 12.5, 1.0) == pytest.approx(1 - math.exp(-0.8))
    assert no_spare_probability(2, 10, 12.5, 1.0) == pytest.approx(1 - 1.8 * math.exp(-0.8))
    faults = Faults(device_mtbf_h=100.0, restart_s=600.0, reschedule_s=3600.0, node_repair_h=1.0)
    assert [round(recovery_s(faults, k, 10, 8), 1) for k in range(3)] == [4200.0, 2582.4, 1288.3]
    assert candidates(1000, "auto") == list(range(21)) and candidates(10, "auto") == [0, 1, 2]
    assert candidates(10, "3") == [3]


def _by_hand(option, faults: Faults, gpus: int) -> float:
    """tokens/s x Daly's goodput at Young's interval, from the option's own step and save time."""
    mtbf = faults.device_mtbf_h * 3600 / option.prediction.devices_used
    save = option.advice.checkpoint_s
    restart = (
        faults.restart_s
        + no_spare_probability(option.spares, option.nodes, faults.device_mtbf_h / gpus, faults.node_repair_h)
        * faults.reschedule_s
    )
    return option.prediction.tokens_per_s * goodput(young_interval(save, mtbf), save, restart, mtbf)


@pytest.mark.parametrize(("mtbf_h", "want"), [(200.0, 2), (1e7, 0)])
def test_the_spare_count_with_the_most_tokens_per_wall_second_wins(mtbf_h, want):
    # 12 nodes, tp 8: dp 12, (11: 240 sequences do not split), 10. Failing GPUs and a 2 h
    # reschedule make 2 spares worth their 2 nodes; GPUs that never fail make spares a loss.
    cluster = build_cluster({"device": "h100", "nodes": 12})
    faults = Faults(device_mtbf_h=mtbf_h, restart_s=600.0, reschedule_s=7200.0, node_repair_h=4.0)
    options = spare_options(SHAPE, cluster, 240, "bf16", faults, [0, 1, 2], PINS)
    assert [o.nodes for o in options] == [12, 11, 10] and options[1].prediction is None
    rates = {o.spares: _by_hand(o, faults, 8) for o in options if o.prediction}
    assert {o.spares: o.rate for o in options if o.prediction} == pytest.approx(rates)
    assert best_option(options).spares == want == max(rates, key=rates.get)


def test_plan_prints_the_trade_off_and_refuses_bad_spares(capsys):
    args = ["--model.preset", "llama-7b", "--cluster.device", "h100", "--cluster.nodes", "12"]
    args += ["--train.global_batch", "240", "--parallel.tp", "8", "--parallel.pp", "1"]
    args += ["--faults.device_mtbf_h", "200", "--faults.reschedule_s", "7200", "--faults.node_repair_h", "4"]
    code, out, err = plan_cli(capsys, *args, "--spares", "auto", "--batch-within", "0")
    assert code == 0, err
    assert "spares: use 10 nodes, 2 spares: expected " in out and "  instead: use 12 nodes, 0 spares" in out
    assert "no layout of the model and batch on the nodes 1 other counts leave: [1]" in out
    # Within 5% of the batch (the default) the 11 nodes train 242 sequences (dp 11 x 22).
    code, out, err = plan_cli(capsys, *args, "--spares", "auto")
    assert code == 0 and "spares: use 10 nodes, 2 spares: expected " in out, err
    assert "  instead: use 11 nodes, 1 spares, global batch 242 (asked 240): expected " in out
    code, _, err = plan_cli(capsys, *args, "--spares", "12")
    assert code != 0 and "--spares" in err and "below 12 nodes" in err
    code, _, err = plan_cli(capsys, *args, "--spares", "auto", "--layout", "tp=8,dp=12,mbs=1")
    assert code != 0 and "drop --layout" in err


TOPOLOGY = ["[topology]", "gpus_per_node = 8", "nvlink_gbps = 370", "leaf_gbps = 48", "spine_gbps = 24"]


def test_the_batch_is_chosen_with_the_nodes(tmp_path, capsys):
    """11 healthy nodes of 12 (one drained), tp 8 x pp 1 pinned, batch 224, GPUs that do not fail
    (spares buy nothing). By hand: dp 11 splits no batch of 224; the nearest within 5% that dp 11
    splits are 220 (4 away) and 231 (7 away); 10 nodes (dp 10) take 220 too (225 needs dp 5, 230
    is 6 away), 9 nodes 225 (216 is 8 away). All 11 nodes at 220 have the most tokens/s x goodput. Without
    --spares the 11 nodes fail the search in one line naming the batch that would split and
    --spares auto."""
    from threefold.planner.spares import batch_tiers

    assert batch_tiers(224, 88, 0.05) == [[224], [220], [231]]
    assert batch_tiers(224, 80, 0.05) == [[224], [225], [220], [230]]  # 225: dp 5 (no layout at tp 8, pp 1)
    assert batch_tiers(224, 72, 0.05)[:2] == [[224], [225]]
    lines = TOPOLOGY + ['drain = ["n11"]'] + [f'[[node]]\nname = "n{i:02d}"\nleaf = "leaf{i % 3}"' for i in range(12)]
    (tmp_path / "topo.toml").write_text("\n".join(lines) + "\n")
    args = ["--model.preset", "llama-7b", "--cluster.device", "h100", "--train.global_batch", "224"]
    args += ["--parallel.tp", "8", "--parallel.pp", "1", "--topology", str(tmp_path / "topo.toml")]
    args += ["--faults.device_mtbf_h", "1e7"]
    code, out, err = plan_cli(capsys, *args, "--spares", "auto", "--emit-config", str(tmp_path / "run.toml"))
    assert code == 0, err
    chosen = next(line for line in out.splitlines() if line.startswith("spares: "))
    assert chosen.startswith("spares: use 11 nodes, 0 spares, global batch 220 (asked 224): expected "), chosen
    assert "global_batch = 220" in (tmp_path / "run.toml").read_text()
    # The same options computed directly: each count's nearest batch, and the rates they give.
    # (param_gather forward: the plan's for a run's default parallel.overlap_param_gather)
    cluster = build_cluster(
        {"device": "h100", "nodes": 11, "inter_bw_gbps": 48, "intra_bw_gbps": 370, "param_gather": "forward"}
    )
    options = spare_options(SHAPE, cluster, 224, "bf16", Faults(device_mtbf_h=1e7), [0, 1, 2], {"tp": 8, "pp": 1}, 0.05)
    assert [(o.nodes, o.batch) for o in options] == [(11, 220), (10, 220), (9, 225)]
    assert best_option(options) is options[0] and options[0].rate > 1.1 * max(o.rate for o in options[1:])
    assert f"= {options[0].rate:,.0f} tokens/s" in chosen
    code, out, err = plan_cli(capsys, *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "no layout of llama-7b on 11 x 8 h100 is possible" in err and "dp=11" in err
    assert "a global batch of 220 splits over the 11 nodes; or --spares auto leaves nodes out as spares" in err


def test_with_a_topology_each_count_weighs_the_layouts_it_places(tmp_path, capsys):
    """37 nodes (prime): within 5% of 256 they train 259 sequences at dp 37 or 259, and blocks
    of tp 2 or 4 would then not fill whole 8-GPU nodes. Each spare count weighs only layouts the
    topology places, so the plan places its choice instead of failing on it; the rest are listed
    as rejected for placement."""
    lines = TOPOLOGY + [f'[[node]]\nname = "n{i:02d}"\nleaf = "leaf{i % 3}"' for i in range(37)]
    (tmp_path / "topo.toml").write_text("\n".join(lines) + "\n")
    args = ["--model.preset", "llama-7b", "--cluster.device", "h100", "--train.global_batch", "256"]
    args += ["--topology", str(tmp_path / "topo.toml"), "--spares", "auto", "--json"]
    code, out, err = plan_cli(capsys, *args)
    assert code == 0, err
    doc = json.loads(out)
    first = doc["layouts"][0]
    assert doc["placement"]["hosts"] and doc["placement"]["layout"].startswith(
        f"tp={first['tp']},pp={first['pp']},dp={first['dp']},"
    )
    code, out, err = plan_cli(capsys, *args[:-3], "--spares", "0", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert "37 nodes, 0 spares, global batch 259" in doc["spares"][0]
    assert "tp=8" in doc["placement"]["layout"]  # dp 37 places only with tp filling the node
    assert any(r["kind"] == "placement" for r in doc["rejected"]), doc["rejected"]
