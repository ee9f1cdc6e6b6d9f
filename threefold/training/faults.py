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
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from threefold.config import TrainConfig
from threefold.errors import ConfigError

ENV = "THREEFOLD_FAULT"
KINDS = {
    "kill": ({"rank", "step"}, set()),
    "killnode": ({"rank", "step"}, set()),
    "hang": ({"rank", "step"}, set()),
    "slow": ({"rank", "factor"}, {"step"}),
    "nan": ({"step"}, {"rank", "count"}),
    "corrupt": ({"step"}, {"file"}),
}
VALID = "e.g. kill:rank=1:step=5, hang:rank=0:step=3, slow:rank=1:factor=3, nan:step=4:count=2, corrupt:step=4"


# (run, fault, step) already fired in this process. A rollback rebuilds the training state
# (and its injector) in the same process; a fault must not fire again on the replayed steps.
# Keyed by the run (its log directory) so that another run in the same process starts afresh.
_FIRED: set[tuple] = set()


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int = 0
    factor: float = 1.0
    count: int = 1
    file: str = "rank00000.pt"


def parse(spec: str, key: str = ENV) -> list[Fault]:
    """Faults of a spec string; a malformed one is a ConfigError naming `key`."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise ConfigError(key, f"unknown fault kind {kind!r} in {item!r}", "kinds: " + ", ".join(KINDS))
        values: dict = {}
        for pair in pairs:
            name, sep, raw = pair.partition("=")
            required, optional = KINDS[kind]
            if not sep or name not in required | optional:
                raise ConfigError(
                    key,
                    f"{pair!r} in {item!r} is not a key=value of {kind}",
                    "keys: " + ", ".join(sorted(required | optional)),
                )
            try:
                values[name] = raw if name == "file" else (float(raw) if name == "factor" else int(raw))
            except ValueError:
                raise ConfigError(key, f"{name}={raw!r} in {item!r} is not a number", VALID) from None
            if name != "file" and values[name] < (1 if name in ("factor", "count") else 0):
                raise ConfigError(key, f"{name}={raw} in {item!r} is out of range", VALID)
        missing = KINDS[kind][0] - set(values)
        if missing:
            raise ConfigError(key, f"{item!r} needs {', '.join(sorted(missing))}", VALID)
        faults.append(Fault(kind, **values))
    return faults


def spec_of(train: TrainConfig) -> tuple[str, str]:
    """(spec, where it came from): the environment overrides train.faults."""
    env = os.environ.get(ENV, "")
    return (env, ENV) if env else (train.faults, "train.faults")


def check(train: TrainConfig, world_size: int, restart_count: int = 0) -> None:
    """Refuse a malformed spec, or a rank outside the world, before any worker starts. After a
    restart the world may have shrunk (a node left): a fault for a rank now gone is moot."""
    spec, key = spec_of(train)
    for f in parse(spec, key):
        if f.rank is not None and f.rank >= world_size and restart_count == 0:
            raise ConfigError(
                key,
                f"{f.kind} names rank {f.rank} but the world has {world_size} ranks",
                f"valid: 0 to {world_size - 1}",
            )


class FaultInjector:
    """The faults that concern this rank, fired at the points the training loop reports."""

    def __init__(self, faults: list[Fault], rank: int, restart_count: int, run: str = ""):
        first = restart_count == 0
        self.rank, self.run = rank, run
        self.faults = [f for f in faults if f.rank in (None, rank) and (f.kind == "slow" or first)]
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
                _kill_node()
            if kind in ("kill", "killnode"):
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # a hang: only the collective timeout of the other ranks ends it
                time.sleep(3600)

    def slow(self, step: int, compute_s: float) -> float:
        """Stretch this step's compute by the slow factor (sleeping); returns the compute time
        the rank now took. Sleeping before the gradient reduction delays the peers too."""
        for f in self.faults:
            if f.kind == "slow" and step >= f.step:
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


def _kill_node() -> None:
    """SIGKILL this worker's agent and the agent's other workers (found through /proc):
    the node is gone at once, as when a machine loses power."""
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
