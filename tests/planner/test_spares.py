"""Hot spares (planner/spares.py, planner/faults.py): the chance a failure finds no spare, what a
failure then costs, and the count that maximises throughput x goodput, on a cluster small enough
to check by hand."""

from __future__ import annotations

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
    code, out, err = plan_cli(capsys, *args, "--spares", "auto")
    assert code == 0, err
    assert "spares: use 10 nodes, 2 spares: expected " in out and "  instead: use 12 nodes, 0 spares" in out
    assert "no layout of the model and batch on the nodes 1 other counts leave: [1]" in out
    code, _, err = plan_cli(capsys, *args, "--spares", "12")
    assert code != 0 and "--spares" in err and "below 12 nodes" in err
    code, _, err = plan_cli(capsys, *args, "--spares", "auto", "--layout", "tp=8,dp=12,mbs=1")
    assert code != 0 and "drop --layout" in err
