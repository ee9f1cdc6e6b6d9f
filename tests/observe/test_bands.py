"""Expected-time bands (observe/bands.py): a tuned run's measured shares become bands that a
later run is checked against on every report step; an injected slowdown is named, a clean run
is not. Single-process CPU runs (in this process, a few seconds each)."""

from __future__ import annotations

import pytest

from threefold.cli import main
from threefold.errors import ConfigError
from threefold.observe.bands import Band, BandCheck, bands_toml, read_bands

from harness import run_training

INTERVAL = 2
RUN = {
    "model.preset": "tiny",
    "train.steps": 12,
    "train.warmup_steps": 1,
    "train.global_batch": 4,
    "train.micro_batch": 4,
    "log.spans": "true",
    "log.interval": INTERVAL,
}
SLOW_FROM = 5  # 0-based loop step of the injection: metrics step 6


@pytest.fixture(scope="module")
def bands_file(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("bands")
    run_training(RUN, root / "tuned", cache_dir)
    measured = root / "tuned.bands.toml"
    assert main(["report", str(root / "tuned"), "--no-plots", "--write-bands", str(measured)]) == 0
    # On this shared 2-core host other jobs move the forward/backward split between runs by up to
    # ~8 points (a clean run's forward share: 23% to 40% of the step), more than one run's spread
    # shows: widen every band to +-10 points. The injected slowdown moves `other` by ~60.
    bands = {name: Band(b.share, max(b.width, 0.10)) for name, b in read_bands(str(measured)).items()}
    path = root / "tuned.wide.bands.toml"
    path.write_text(bands_toml(bands))
    return root, path


def alerts_by_step(metrics: list[dict]) -> dict[int, list[str]]:
    return {m["step"]: [a["category"] for a in m["band_alerts"]] for m in metrics if "band_alerts" in m}


def test_an_injected_slowdown_is_named_within_two_intervals(bands_file, cache_dir, capsys):
    root, path = bands_file
    slow = {**RUN, "log.bands": str(path), "train.faults": f"slow:rank=0:factor=3:step={SLOW_FROM}"}
    metrics = run_training(slow, root / "slowed", cache_dir)
    named = alerts_by_step(metrics)
    assert named, "the run checked no bands"
    injected = SLOW_FROM + 1
    assert all(not cats for step, cats in named.items() if step < injected), named
    first = min(step for step, cats in named.items() if cats)
    assert first <= injected + 2 * INTERVAL, named
    # faults.slow sleeps between the schedule and the gradient reduction: outside every span.
    assert "other" in named[first], named
    capsys.readouterr()
    assert main(["report", str(root / "slowed"), "--no-plots"]) == 0
    assert "out of band: other " in capsys.readouterr().out


def test_a_clean_run_names_nothing(bands_file, cache_dir, capsys):
    root, path = bands_file
    metrics = run_training({**RUN, "log.bands": str(path)}, root / "clean", cache_dir)
    named = alerts_by_step(metrics)
    assert named and not any(named.values()), named
    assert main(["report", str(root / "clean"), "--no-plots"]) == 0
    assert "bands: every category within its band" in capsys.readouterr().out


def test_band_check_names_the_step_a_category_left_its_band():
    check = BandCheck({"dp_exposed": Band(0.04, 0.03)})
    assert check.check(2, 2, {"dp_exposed": 0.5}) is None  # the start-up window is not checked
    assert check.check(4, 2, {"dp_exposed": 0.05}) == []
    assert check.check(6, 2, {"dp_exposed": 0.18}) == []  # one line out: not yet
    assert [a["since"] for a in check.check(8, 2, {"dp_exposed": 0.20})] == [6]
    assert [a["since"] for a in check.check(10, 2, {"dp_exposed": 0.20})] == [6]
    assert check.check(12, 2, {"dp_exposed": 0.04}) == []
    assert check.check(14, 2, {"dp_exposed": 0.10}) == []
    assert check.check(16, 2, {"dp_exposed": 0.05}) == []  # back in: the excursion is forgotten


@pytest.mark.parametrize(
    "body, words",
    [
        ("[bands]\nforwards = [0.1, 0.02]\n", "unknown category"),
        ("[bands]\nforward = [0.1]\n", r"is not \[share, width\]"),
        ("[bands]\nforward = [1.5, 0.1]\n", r"is not \[share, width\]"),
        ("[other]\nx = 1\n", r"has no \[bands\] table"),
    ],
)
def test_a_bad_bands_file_is_one_clear_error(tmp_path, body, words):
    path = tmp_path / "b.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=words):
        read_bands(str(path))


def test_bands_round_trip(tmp_path):
    bands = {"dp_exposed": Band(0.04, 0.03), "pp_bubble": Band(0.2, 0.05)}
    path = tmp_path / "b.toml"
    path.write_text(bands_toml(bands, "note"))
    assert read_bands(str(path)) == bands
