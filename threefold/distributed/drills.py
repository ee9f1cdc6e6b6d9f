"""The drill spec: `train.faults` or THREEFOLD_FAULT, a list of `kind:key=value:...` separated
by `,` (training/faults.py documents the kinds that act on a training step; preflight/ the
ones that act on its probes). Parsed here, on the floor of the comm layer, because one kind
(slowlink) acts inside it. Drills are for tests; nothing that detects a fault reads them.

    slowlink:ranks=A-B:ms=X    every exchange between ranks A and B waits X ms more, point to
                               point or inside a group collective they share
    slowdevice:rank=R:factor=F the node probe's kernels and training compute on rank R run F x slower
    slowlayer:layer=L:factor=F the transformer layer with global index L runs F x slower (its forward
                               and backward), on every rank that holds it (or :rank=R only), from step 0 (or :step=S on)
    hotexpert:layer=L:expert=E MoE layer L routes every token to expert E first (its input shifted
                               along the expert's router row), on every rank (or :rank=R only)
    stack:rank=R:KEY=VALUE     rank R's stack fingerprint reports VALUE for KEY
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from threefold.config import TrainConfig
from threefold.errors import ConfigError

ENV = "THREEFOLD_FAULT"
KINDS = {
    "kill": ({"rank", "step"}, set()),
    "killnode": ({"rank", "step"}, set()),
    "hang": ({"rank", "step"}, set()),
    "slow": ({"rank", "factor"}, {"step", "steps"}),
    "nan": ({"step"}, {"rank", "count"}),
    "corrupt": ({"step"}, {"file", "count"}),
    "ramloss": ({"rank", "step"}, set()),
    "enospc": ({"rank", "step"}, {"count"}),
    "slowlink": ({"ranks", "ms"}, set()),
    "slowdevice": ({"rank", "factor"}, set()),
    "slowlayer": ({"layer", "factor"}, {"rank", "step"}),
    "hotexpert": ({"layer", "expert"}, {"rank"}),
    "stack": ({"rank"}, set()),  # plus any KEY=VALUE of the fingerprint
}
VALID = (
    "e.g. kill:rank=1:step=5, hang:rank=0:step=3, slow:rank=1:factor=3, nan:step=4:count=2, corrupt:step=4, "
    "slowlink:ranks=1-2:ms=20, slowdevice:rank=1:factor=3, slowlayer:layer=3:factor=3, hotexpert:layer=1:expert=0, "
    "stack:rank=1:nccl=2.28.9"
)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int = 0
    factor: float = 1.0
    count: int = 1
    steps: int = 0
    """slow: how many steps it lasts from its step (0: to the end)."""
    file: str = "rank00000.pt"
    ranks: tuple[int, int] | None = None
    """slowlink: the two ranks whose exchanges are delayed."""
    ms: float = 0.0
    layer: int | None = None
    """slowlayer, hotexpert: the global index of the transformer layer."""
    expert: int = 0
    """hotexpert: the expert every token is routed to first."""
    stack: tuple[tuple[str, str], ...] = ()
    """stack: the (key, value) pairs the fingerprint reports instead."""


def _value(kind: str, name: str, raw: str, item: str, key: str):
    """One key=value of a drill, typed; a bad one is a ConfigError naming `key`."""
    try:
        if name == "ranks":
            a, sep, b = raw.partition("-")
            if not sep:
                raise ValueError
            pair = (int(a), int(b))
            if min(pair) < 0 or pair[0] == pair[1]:
                raise ConfigError(key, f"ranks={raw} in {item!r} needs two different ranks", VALID)
            return tuple(sorted(pair))
        if name in ("factor", "ms"):
            value = float(raw)
        else:
            value = int(raw)
    except ValueError:
        raise ConfigError(key, f"{name}={raw!r} in {item!r} is not a number", VALID) from None
    if value < (1 if name in ("factor", "count") else 0):
        raise ConfigError(key, f"{name}={raw} in {item!r} is out of range", VALID)
    return value


def parse(spec: str, key: str = ENV) -> list[Fault]:
    """Faults of a spec string; a malformed one is a ConfigError naming `key`."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise ConfigError(key, f"unknown fault kind {kind!r} in {item!r}", "kinds: " + ", ".join(KINDS))
        required, optional = KINDS[kind]
        values: dict = {}
        stack: list[tuple[str, str]] = []
        for pair in pairs:
            name, sep, raw = pair.partition("=")
            if kind == "stack" and sep and name != "rank":
                stack.append((name, raw))  # any fingerprint key
                continue
            if not sep or name not in required | optional:
                raise ConfigError(
                    key,
                    f"{pair!r} in {item!r} is not a key=value of {kind}",
                    "keys: " + ", ".join(sorted(required | optional)),
                )
            values[name] = raw if name == "file" else _value(kind, name, raw, item, key)
        missing = required - set(values)
        if missing:
            raise ConfigError(key, f"{item!r} needs {', '.join(sorted(missing))}", VALID)
        if kind == "stack":
            if not stack:
                raise ConfigError(key, f"{item!r} names no KEY=VALUE to report", "e.g. stack:rank=1:nccl=2.28.9")
            values["stack"] = tuple(stack)
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
        named = [f.rank] if f.rank is not None else list(f.ranks or ())
        if any(r >= world_size for r in named) and restart_count == 0:
            raise ConfigError(
                key,
                f"{f.kind} names rank {max(named)} but the world has {world_size} ranks",
                f"valid: 0 to {world_size - 1}",
            )
