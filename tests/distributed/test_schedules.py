"""Pipeline schedules as data: completeness, order, matching, deadlock freedom, bubble, memory.

Everything here runs without processes: schedules are lists of actions and the simulator
executes them with unit costs (F = 1, B = 2; zb: F = B = W = 1).
"""

from dataclasses import replace

import pytest

from threefold.distributed.pipeline import (
    SCHEDULES,
    Action,
    DeadlockError,
    ScheduleError,
    bubble_theory,
    build_schedule,
    check_schedule,
    format_schedule,
    format_timeline,
    group_batches,
    simulate,
)
from threefold.errors import ConfigError

ZB_COSTS = {"f": 1, "b": 1, "w": 1}


def valid_settings(name, p):
    """Every valid (m, v) with m in 1..16 and v in 2..4 for interleaved."""
    for m in range(1, 17):
        for v in (2, 3, 4) if name == "interleaved" else (1,):
            if name == "interleaved" and (p < 2 or m % p):
                continue
            yield m, v


def costs(name):
    return ZB_COSTS if name == "zb" else {}


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_complete_ordered_matched_and_deadlock_free(name, p):
    for m, v in valid_settings(name, p):
        check_schedule(build_schedule(name, p, m, v), p, m, v)


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("name", SCHEDULES)
def test_bubble_matches_theory(name, p):
    for m, v in valid_settings(name, p):
        if name == "zb" and m < p:
            continue  # ZB-H1's (p-1)/(3m+p-1) assumes a steady state
        result = simulate(build_schedule(name, p, m, v), **costs(name))
        assert result.bubble == pytest.approx(bubble_theory(name, p, m, v), abs=1e-12), (name, p, m, v)


def test_bubble_numbers_for_p4_m8():
    bubbles = {
        name: simulate(build_schedule(name, 4, 8, 2 if name == "interleaved" else 1), **costs(name)).bubble
        for name in SCHEDULES
    }
    assert bubbles["gpipe"] == pytest.approx(3 / 11)
    assert bubbles["1f1b"] == pytest.approx(3 / 11)
    assert bubbles["interleaved"] == pytest.approx(3 / 19)  # (1/v)(p-1)/m = 3/16 of the ideal time
    assert bubbles["zb"] == pytest.approx(3 / 27)


def test_interleaved_bubble_is_one_vth_of_the_ideal_time():
    for p, m, v in ((2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 3)):
        b = simulate(build_schedule("interleaved", p, m, v)).bubble
        assert b / (1 - b) == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_bubble_is_below_1f1b(p):
    for m in range(p, 17):
        zb = simulate(build_schedule("zb", p, m), **ZB_COSTS).bubble
        ofob = simulate(build_schedule("1f1b", p, m)).bubble
        assert zb < ofob, (p, m)


def test_strict_rule_costs_nothing_but_interleaved_stalls():
    # With sends waited on at once (rendezvous), the comm placement keeps nominal timing for
    # gpipe, 1f1b and zb; interleaved can stall but never deadlocks (check_schedule proves it).
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2)):
        for p, m in ((2, 4), (4, 8), (5, 10)):
            acts = build_schedule(name, p, m, v)
            eager = simulate(acts, **costs(name))
            strict = simulate(acts, sends="rendezvous", **costs(name))
            if name == "interleaved":
                assert strict.makespan >= eager.makespan
            else:
                assert strict.makespan == eager.makespan, (name, p, m)


def test_peak_inflight_activations():
    p = 4
    for m in (2, 8, 16):
        ofob = simulate(build_schedule("1f1b", p, m))
        gp = simulate(build_schedule("gpipe", p, m))
        zb = simulate(build_schedule("zb", p, m), **ZB_COSTS)
        assert gp.peak_inflight == [m] * p
        assert ofob.peak_inflight == [min(p - r, m) for r in range(p)]
        assert ofob.peak_inflight[0] <= p
        assert zb.peak_inflight == ofob.peak_inflight  # B frees what 1F1B's backward frees
        assert max(zb.peak_held) == ofob.peak_held[0]  # deferred W never exceeds stage 0's 1F1B peak
    stage0 = {name: simulate(build_schedule(name, 4, 16)).peak_inflight[0] for name in ("1f1b", "gpipe")}
    assert stage0["1f1b"] < stage0["gpipe"]
    # Interleaved: stage 0 warms up (v-1)p + 2(p-1) chunks, then holds one more (Megatron).
    assert simulate(build_schedule("interleaved", 4, 8, 2)).peak_inflight == [11, 9, 7, 5]


def test_any_costs_and_latency_still_run():
    for name in SCHEDULES:
        v = 3 if name == "interleaved" else 1
        acts = build_schedule(name, 4, 8, v)
        base = simulate(acts, f=1.3, b=0.7, w=2.1)
        slow = simulate(acts, f=1.3, b=0.7, w=2.1, latency=0.25)
        strict = simulate(acts, f=1.3, b=0.7, w=2.1, latency=0.25, sends="rendezvous")
        assert 0 <= base.bubble < 1
        assert base.makespan < slow.makespan <= strict.makespan


@pytest.mark.parametrize(
    "name, p, m, v, key, words",
    [
        ("interleaved", 4, 6, 2, "parallel.microbatches", "multiple of pp=4"),
        ("interleaved", 4, 2, 2, "parallel.microbatches", "multiple of pp=4"),
        ("interleaved", 4, 8, 1, "parallel.vpp", "needs vpp >= 2"),
        ("interleaved", 1, 4, 2, "parallel.pp", "needs pp >= 2"),
        ("1f1b", 4, 8, 2, "parallel.vpp", "needs schedule=interleaved"),
        ("zb", 4, 8, 3, "parallel.vpp", "needs schedule=interleaved"),
        ("gpipe", 0, 8, 1, "parallel.pp", "positive integer"),
        ("1f1b", 2, 0, 1, "parallel.microbatches", "positive integer"),
        ("pipedream", 2, 4, 1, "parallel.schedule", "gpipe, 1f1b, interleaved, zb"),
    ],
)
def test_invalid_settings_are_refused_in_one_line(name, p, m, v, key, words):
    with pytest.raises(ValueError) as info:
        build_schedule(name, p, m, v)
    text = str(info.value)
    assert isinstance(info.value, ScheduleError) and isinstance(info.value, ConfigError)
    assert "\n" not in text and text.startswith(key) and words in text


def test_action_is_readable():
    assert str(Action("F", 3, 1)) == "F3c1"
    assert str(Action("W", 0)) == "W0c0"
    assert str(Action("RECV_B", 2, 0, 1)) == "RECV_B2c0<-1"
    assert str(Action("SEND_F", 3, 1, 2)) == "SEND_F3c1->2"
    with pytest.raises(ValueError):
        Action("X", 0)
    with pytest.raises(ValueError):
        Action("F", 0, 0, 1)
    with pytest.raises(ValueError):
        Action("SEND_F", 0, 0)


def test_format_schedule_and_timeline():
    acts = build_schedule("1f1b", 2, 2)
    table = format_schedule(acts)
    assert table.splitlines()[0].startswith("rank 0 | F0c0") and "[SEND_F1c0->1 RECV_B0c0<-1]" in table
    assert len(table.splitlines()) == 2
    assert "[" not in format_schedule(acts, comms=False)
    assert format_timeline(simulate(acts)).splitlines() == ["rank 0 | FF..BB.BB", "rank 1 | .FBBFBB.."]


def test_group_batches_splits_at_compute():
    for name in SCHEDULES:
        for acts in build_schedule(name, 4, 8, 2 if name == "interleaved" else 1):
            steps = group_batches(acts)
            flat = [a for s in steps for a in (s if isinstance(s, tuple) else (s,))]
            assert flat == acts
            assert all(not (isinstance(x, tuple) and isinstance(y, tuple)) for x, y in zip(steps, steps[1:]))


# ------------------------------------------------------------------ check_schedule catches faults


def test_check_catches_a_missing_backward():
    acts = build_schedule("1f1b", 2, 2)
    acts[0] = [a for a in acts[0] if str(a) != "B1c0"]
    with pytest.raises(AssertionError, match=r"rank 0: B1c0 \(stage 0\) appears 0 times, expected 1"):
        check_schedule(acts, 2, 2)


def test_check_catches_backward_before_forward():
    acts = build_schedule("gpipe", 1, 2)
    acts[0] = [Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)]
    with pytest.raises(AssertionError, match="rank 0: B0c0 .* comes before F0c0"):
        check_schedule(acts, 1, 2)


def test_check_catches_a_wrong_peer():
    acts = build_schedule("1f1b", 3, 2)
    acts[0] = [replace(a, peer=2) if a.kind == "SEND_F" else a for a in acts[0]]
    with pytest.raises(AssertionError, match="names peer 2, but stage 1 is on rank 1"):
        check_schedule(acts, 3, 2)


def test_check_catches_a_deadlock():
    acts = build_schedule("1f1b", 2, 1)
    recv = next(a for a in acts[0] if a.kind == "RECV_B")
    acts[0] = [recv] + [a for a in acts[0] if a != recv]  # waits for a gradient before sending F
    with pytest.raises(AssertionError, match="deadlock: rank 0 waits at \\[RECV_B0c0<-1\\]"):
        check_schedule(acts, 2, 1)


def test_check_catches_crossed_sends():
    acts = build_schedule("1f1b", 2, 4)
    first = acts[0].pop(acts[0].index(Action("SEND_F", 0, 0, 1)))
    acts[0].insert(acts[0].index(Action("SEND_F", 1, 0, 1)) + 1, first)  # still after F0, now behind F1's
    with pytest.raises(AssertionError, match=r"SEND_F1c0->1 \(stage 0\) pairs with RECV_F0c0<-0 on rank 1"):
        check_schedule(acts, 2, 4)


def test_check_catches_an_order_only_tags_could_fix():
    # p=2 interleaved: rank 0 sends both activations and gradients to rank 1. Swapping them
    # inside a batch keeps FIFO per direction but breaks an untagged transport (NCCL).
    acts = build_schedule("interleaved", 2, 4, 2)
    steps = group_batches(acts[0])
    batch = next(s for s in steps if isinstance(s, tuple) and {"SEND_F", "SEND_B"} <= {a.kind for a in s})
    i, j = (acts[0].index(a) for a in batch if a.kind in ("SEND_F", "SEND_B"))
    acts[0][i], acts[0][j] = acts[0][j], acts[0][i]
    with pytest.raises(AssertionError, match="untagged transport"):
        check_schedule(acts, 2, 4, 2)


def test_strict_rule_deadlock_that_eager_sends_survive():
    # Each rank sends before computing and receives after: fine with buffered sends, a
    # deadlock when a send waits for its receive to be posted.
    acts = [
        [Action("SEND_F", 0, 0, 1), Action("F", 1), Action("RECV_B", 0, 0, 1)],
        [Action("SEND_B", 0, 0, 0), Action("F", 1), Action("RECV_F", 0, 0, 0)],
    ]
    simulate(acts, sends="eager")
    with pytest.raises(DeadlockError, match="rank 0 waits at \\[SEND_F0c0->1\\] for rank 1 to reach RECV_F0c0<-0"):
        simulate(acts, sends="rendezvous")
