"""What a newcomer sees after the README's first command, `threefold train` with the defaults
(fewer steps here): a checkpoint at the end with the command that samples from it, and a report
with the time breakdown, its plots and its HTML page."""

from __future__ import annotations

import re
import subprocess
import sys


def _threefold(*args: str, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "threefold", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_default_run_saves_reports_its_time_and_can_be_sampled(tmp_path, cache_dir):
    train = _threefold("train", "--train.steps", "12", "--data.cache_dir", cache_dir, cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    run = tmp_path / "runs" / "latest"
    saved = run / "checkpoints" / "step_00000012"
    assert saved.is_dir()
    command = re.search(r"sample from it: (threefold generate --checkpoint \S+ --prompt 'def ')", train.stdout)
    assert command and "runs/latest/checkpoints/step_00000012 " in command.group(1), train.stdout[-2000:]

    report = _threefold("report", "runs/latest", cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "no time breakdown" not in report.stdout and "matplotlib is not installed" not in report.stdout
    assert "forward" in report.stdout and "backward" in report.stdout, report.stdout[-3000:]
    for name in ("loss.png", "breakdown.png", "report.html"):
        assert (run / "report" / name).stat().st_size > 0, name

    sample = _threefold(
        "generate", "--checkpoint", str(saved), "--prompt", "def ", "--max-new-tokens", "8", cwd=tmp_path
    )
    assert sample.returncode == 0 and sample.stdout.startswith("def "), sample.stderr[-2000:]
