"""Export for monitoring (observe/prometheus.py, observe/bands.py's rules): a real Prometheus server
scrapes a running CPU job's endpoint and fires a band's alert; promtool accepts the rules that
`threefold report --write-bands` writes; the endpoint's findings come and go with the diagnosis;
a port without the client is one line. The Prometheus test needs Debian's `prometheus` package
(.ci/run installs it) and skips, saying so, without it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from threefold.cli import main
from threefold.config import build_config
from threefold.errors import ConfigError
from threefold.observe.bands import Band, rules_path, write_rules
from threefold.observe.findings import Finding
from threefold.validate import validate

from harness import free_port

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
NO_PROMETHEUS = "the prometheus binary is not on PATH (apt-get install prometheus; .ci/run does)"
NO_PROMTOOL = "promtool is not on PATH (apt-get install prometheus; .ci/run does)"
# No share of a real step is 99.9% optimizer: this band's alert must fire. No step is more than
# half evaluation in a run without evaluation: that one must not.
BANDS = {"optimizer": Band(0.999, 0.0005), "eval": Band(0.0, 0.5)}


def _get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


def _query(base: str, promql: str) -> list[dict]:
    doc = json.loads(_get(f"{base}/api/v1/query?query={urllib.parse.quote(promql)}"))
    return doc["data"]["result"]


def _promtool(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=30)


def _train(log: Path, cache_dir: str, port: int) -> subprocess.Popen:
    """`threefold train` at dp 2, long enough to be stopped (SIGTERM) once the test has its answer."""
    args = ["--model.preset", "tiny", "--model.layers", "2", "--model.seq_len", "64", "--parallel.dp", "2"]
    args += ["--train.steps", "100000", "--train.global_batch", "4", "--train.micro_batch", "2"]
    args += ["--log.interval", "5", "--log.spans", "true", "--log.quiet", "true", "--log.dir", str(log)]
    args += ["--data.cache_dir", cache_dir, "--log.prometheus_port", str(port), "--log.prometheus_host", "127.0.0.1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return subprocess.Popen([sys.executable, "-m", "threefold", "train", *args], env=env, **pipes)


def _prometheus(tmp_path: Path, target: int, rules: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - '{rules}'\n"
        "scrape_configs:\n  - job_name: threefold\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{target}']\n"
    )
    cmd = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
    cmd += [f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    log = open(tmp_path / "prometheus.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


@pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)
@pytest.mark.timeout(240)
def test_a_real_prometheus_scrapes_a_running_job_and_fires_a_band(tmp_path, cache_dir):
    pytest.importorskip("prometheus_client")
    rules = write_rules(tmp_path / "impossible.rules.yml", BANDS)
    endpoint = free_port()
    job = _train(tmp_path / "log", cache_dir, endpoint)
    server, base = _prometheus(tmp_path, endpoint, rules)
    series, firing = [], []
    try:
        # The job's start-up on a busy 2-core host is most of the wait; once its series arrive, the
        # alert follows at the next report step (5 steps) and rule evaluation (1 s).
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not (series and firing):
            assert job.poll() is None, job.communicate()[0][-3000:]
            assert server.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            time.sleep(1)
            try:
                series = _query(base, "threefold_step_time_seconds")
                alerts = json.loads(_get(f"{base}/api/v1/alerts"))["data"]["alerts"]
            except OSError:  # the server is not listening yet
                continue
            firing = [a["labels"]["alertname"] for a in alerts if a["state"] == "firing"]
            if series and not firing:
                deadline = min(deadline, time.monotonic() + 30)
        shares = _query(base, 'threefold_category_share{category="optimizer"}')
        steps = _query(base, "threefold_step")
    finally:
        server.terminate()
        job.send_signal(signal.SIGTERM)  # a stop at the next step boundary, which saves
        out = job.communicate(timeout=90)[0]
        server.wait(timeout=30)
    assert series, f"no threefold_step_time_seconds scraped in 150 s; the job said: {out[-3000:]}"
    assert float(series[0]["value"][1]) > 0 and series[0]["metric"]["job"] == "threefold"
    assert firing == ["ThreefoldBand_optimizer"], firing  # and not the band no step leaves
    assert shares and 0 < float(shares[0]["value"][1]) < 0.9
    assert steps and float(steps[0]["value"][1]) >= 1
    assert "terminated (SIGTERM)" in out, out[-3000:]

    # The stopped run's own bands, as rules beside the bands file: promtool accepts them.
    bands = tmp_path / "tuned.bands.toml"
    assert main(["report", str(tmp_path / "log"), "--no-plots", "--write-bands", str(bands)]) == 0
    written = rules_path(bands)
    assert bands.is_file() and written.name == "tuned.bands.rules.yml"
    assert "alert: ThreefoldBand_optimizer" in written.read_text()
    if PROMTOOL is not None:
        check = _promtool(written)
        assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_promtool_accepts_the_rules_and_rejects_a_broken_file(tmp_path):
    bands = {**BANDS, "dp_exposed": Band(0.04, 0.03), "other": Band(0.5, 0.6), "sync": Band(0.02, 0.03)}
    path = write_rules(tmp_path / "bands.rules.yml", bands, for_s=12.5, comment="it's a comment\nover two lines")
    check = _promtool(path)
    assert check.returncode == 0, check.stdout + check.stderr
    # A band no share can leave (0.5 +- 0.6) has no rule; the findings' rule is always there.
    assert "SUCCESS: 5 rules found" in check.stdout, check.stdout
    text = path.read_text()
    assert "for: 13s" in text and "ThreefoldBand_other" not in text
    assert "'threefold_category_share{category=\"sync\"} > 0.05'" in text  # no lower side below 0
    broken = tmp_path / "broken.rules.yml"
    broken.write_text(text.replace("threefold_category_share{", "threefold_category_share{{"))
    assert _promtool(broken).returncode != 0


def test_the_endpoint_serves_the_step_and_drops_a_cleared_finding():
    pytest.importorskip("prometheus_client")
    from threefold.observe.prometheus import Exporter

    port = free_port()
    cfg = build_config(None, [("log.prometheus_port", str(port)), ("log.prometheus_host", "127.0.0.1")])
    other = Exporter(cfg, types.SimpleNamespace(global_rank=1), False, environ={"LOCAL_RANK": "1"})
    assert other.server is None  # one endpoint per node: its first rank
    exporter = Exporter(cfg, types.SimpleNamespace(global_rank=0), True, environ={})
    record = {"step": 20, "step_time_s": 0.5, "tokens_per_s": 800.0, "mfu": 0.02, "loss": 3.5}
    report = {**record, "time_s": {"mean": {"forward": 0.1, "dp_exposed": 0.2}}, "span_step_s": {"mean": 0.4}}
    link = Finding("slow_link", "pp 1->2", "slow link: pp 1 -> 2", 20, 12, ranks=(1, 2), value=0.038)
    change = Finding("change", "step time", "step time +31% since step 15", 20, 15, category="dp_exposed")
    try:
        exporter.update(report, [link, change])
        text = _get(f"http://127.0.0.1:{port}/metrics")
        assert "threefold_step 20.0" in text and "threefold_step_time_seconds 0.5" in text
        assert 'threefold_category_share{category="dp_exposed"} 0.5' in text
        assert 'threefold_finding{key="pp 1->2",kind="slow_link"} 1.0' in text
        assert 'threefold_slow_link_wait_seconds{link="pp 1->2"} 0.038' in text
        assert 'threefold_change_point_step{category="dp_exposed",key="step time"} 15.0' in text
        exporter.update({**record, "step": 21}, [change])  # the link cleared; shares held until the next report
        text = _get(f"http://127.0.0.1:{port}/metrics")
        assert "threefold_step 21.0" in text and 'category="dp_exposed"} 0.5' in text
        assert "pp 1->2" not in text and 'kind="change"' in text
    finally:
        exporter.close()
    with pytest.raises(OSError):
        _get(f"http://127.0.0.1:{port}/metrics", timeout=1)


def test_a_port_without_the_client_is_one_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "prometheus_client" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"log.prometheus_port: 9400 needs the prometheus-client.*threefold\[prometheus\]"
    ):
        validate(build_config(None, [("log.prometheus_port", "9400")]))
    with pytest.raises(ConfigError, match="log.prometheus_port: 70000 is not a port"):
        validate(build_config(None, [("log.prometheus_port", "70000")]))
    validate(build_config(None, []))  # off by default: no client needed
