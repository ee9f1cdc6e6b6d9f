"""Fault injection for tests and drills: kill, hang or slow a rank, poison a step with NaN,
corrupt a checkpoint file.

A spec is `train.faults` or the environment variable THREEFOLD_FAULT (the variable wins), a
list of faults separated by `,`, each `kind:key=value:key=value`:

    kill:rank=1:step=5         rank 1 dies (SIGKILL) as step 5 begins (first attempt only)
    killnode:rank=1:step=5     rank 1's whole node dies: its elastic agent (the worker's parent)
                               and every worker of that agent (Linux; first attempt only)
    hang:rank=0:step=3         rank 0 stops making progress at step 3 (first attempt only)
    slow:rank=1:factor=3       rank 1's compute takes 3x as long, from step 0 (or :step=S on)
    nan:step=4                 the loss of step 4 is NaN on every rank (or :rank=R only);
                               :count=N poisons N consecutive steps (once per process)
    corrupt:step=4             after the checkpoint of step 4 is published, flip a byte of its
                               rank00000.pt (or :file=NAME)

Steps are 0-based loop indices: `step=5` fires before the sixth optimizer step. Faults that
would recur forever (kill, hang, nan, corrupt) fire only on the elastic agent's first attempt
(TORCHELASTIC_RESTART_COUNT = 0), so the restarted job can succeed.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from torch import nn

from threefold.config import TrainConfig
from threefold.distributed.drills import ENV, KINDS, VALID, Fault, check, parse, spec_of  # noqa: F401 - the drill spec

# (run, fault, step) already fired in this process. A rollback rebuilds the training state
# (and its injector) in the same process; a fault must not fire again on the replayed steps.
# Keyed by the run (its log directory) so that another run in the same process starts afresh.
_FIRED: set[tuple] = set()


class FaultInjector:
    """The faults that concern this rank, fired at the points the training loop reports."""

    def __init__(self, faults: list[Fault], rank: int, restart_count: int, run: str = ""):
        first = restart_count == 0
        self.rank, self.run = rank, run
        # Only the kinds that act on a training step (slowlink acts in the comm layer, stack on
        # the fingerprint: threefold/distributed/drills.py); slow ones on every attempt.
        acting = [f for f in faults if f.kind not in ("slowlink", "stack") and f.rank in (None, rank)]
        self.faults = [f for f in acting if f.kind in ("slow", "slowdevice") or first]
        self.armed = bool(self.faults)
        """Whether any fault concerns this rank: without one a step calls nothing here (RunGuard's
        hooks check this first)."""
        self._poison = False

    @classmethod
    def from_config(cls, train: TrainConfig, run: str, rank: int, restart_count: int) -> FaultInjector:
        """The faults of train.faults (or $THREEFOLD_FAULT) for `rank`; `run` (the log directory)
        keys which faults have fired in this process."""
        spec, key = spec_of(train)
        return cls(parse(spec, key), rank, restart_count, run=run)

    def _take(self, kind: str, step: int) -> Fault | None:
        """The fault of `kind` due at `step`, if it has not fired at that step in this process."""
        for f in self.faults:
            if f.kind == kind and f.step <= step < f.step + f.count and (self.run, f, step) not in _FIRED:
                _FIRED.add((self.run, f, step))
                return f
        return None

    def install(self, chunks: list[nn.Module]) -> None:
        """NaN faults multiply each chunk's output by NaN: the loss, every downstream
        activation and every gradient become NaN, as a real divergence would make them."""
        if any(f.kind == "nan" for f in self.faults):
            for chunk in chunks:
                chunk.register_forward_hook(lambda _m, _i, out: out * float("nan") if self._poison else None)

    def step_begins(self, step: int, on_fault=lambda fault: None) -> None:
        """Kill or hang this rank, or arm the NaN hook, as the spec says for `step`.
        `on_fault` is told first (goodput records when the failure happened)."""
        self._poison = self._take("nan", step) is not None
        for kind in ("kill", "killnode", "hang"):
            fault = self._take(kind, step)
            if fault is None:
                continue
            on_fault(fault)
            print(f"threefold: fault injection: {kind} rank {self.rank} at step {step}", file=sys.stderr, flush=True)
            if kind == "killnode":
                kill_node()
            if kind in ("kill", "killnode"):
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # a hang: only the collective timeout of the other ranks ends it
                time.sleep(3600)

    def slow(self, step: int, compute_s: float) -> float:
        """Stretch this step's compute by the slow factor (sleeping); returns the compute time
        the rank now took. Sleeping before the gradient reduction delays the peers too."""
        for f in self.faults:
            if f.kind in ("slow", "slowdevice") and step >= f.step:
                time.sleep(compute_s * (f.factor - 1.0))
                return compute_s * f.factor
        return compute_s

    def after_save(self, step: int, directory: Path | None) -> None:
        """Flip one byte in the middle of a file of the published checkpoint of `step` (the
        rank that published it, which alone knows its directory)."""
        fault = self._take("corrupt", step)
        if fault is None or directory is None:
            return
        path = directory / fault.file
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        print(f"threefold: fault injection: corrupted {path}", file=sys.stderr, flush=True)


def kill_node() -> None:
    """SIGKILL this worker's agent and the agent's other workers (found through /proc):
    the node is gone at once, as when a machine loses power. The killnode drill, and
    train.preflight_exclude's end of an excluded node (training/worker.py)."""
    agent, me = os.getppid(), os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == agent:
                os.kill(int(entry.name), signal.SIGKILL)
    os.kill(agent, signal.SIGKILL)
