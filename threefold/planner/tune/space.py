"""The space a tune searches: every (dp, tp, pp) whose product is the world, crossed with lists
of micro-batch counts, schedules, ZeRO stages and recompute modes, each candidate checked by
the planner's structural rules and by the trainer's own validation before it can be tried.

A knob that cannot matter is not crossed: the schedule when pp = 1, ZeRO when dp = 1. So the
nominal product (what a naive grid would run) and the distinct runnable candidates differ, and
both are reported.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from threefold.config import Config
from threefold.errors import ConfigError, UserError
from threefold.planner.layout import RECOMPUTE, SCHEDULES, Layout, structural_reason

# Keys of --space and how their values parse.
KEYS = {
    "dp": int,
    "tp": int,
    "pp": int,
    "cp": int,
    "microbatches": int,
    "schedule": str,
    "zero": int,
    "recompute": str,
    "sp": lambda s: s.lower() in ("1", "true", "yes", "on"),
}


@dataclass(frozen=True)
class Candidate:
    """One runnable configuration of the space."""

    layout: Layout
    microbatches: int

    @property
    def name(self) -> str:
        lay = self.layout
        text = f"dp{lay.dp}tp{lay.tp}pp{lay.pp}" + (f"cp{lay.cp}" if lay.cp > 1 else "") + f"-m{self.microbatches}"
        if lay.pp > 1:
            text += "-" + (f"int{lay.vpp or ''}" if lay.schedule == "interleaved" else lay.schedule)
        if lay.dp > 1:
            text += f"-z{lay.zero}"
        if lay.recompute != "none":
            text += f"-rc{lay.recompute}"
        return text + ("-sp" if lay.sp else "")

    def features(self) -> list[float]:
        """Coordinates for the surrogate's distance: log2 degrees and counts, categorical flags."""
        import math

        lay = self.layout
        return [
            math.log2(lay.dp),
            math.log2(lay.tp),
            math.log2(lay.pp),
            math.log2(lay.cp),
            math.log2(self.microbatches),
            float(lay.schedule == "interleaved"),
            float(lay.zero),
            float(RECOMPUTE.index(lay.recompute)),
            float(lay.sp),
        ]


@dataclass
class Space:
    """Lists of values per knob (degrees as allowed values; dp x tp x pp x cp must be the world)."""

    world: int
    values: dict[str, list] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(candidate name, the one-line reason) for combinations a rule or the trainer refuses."""
    nominal: int = 0
    """Size of the plain product of the lists (each degree triple x every other list)."""

    @classmethod
    def parse(cls, cfg: Config, world: int, items: list[str]) -> Space:
        """`items` are --space KEY=V1,V2 strings; a knob left out keeps the config's value
        (the degrees: every divisor triple of the world)."""
        values: dict[str, list] = {}
        for item in items:
            if "=" not in item:
                raise ConfigError("--space", f"{item!r} is not KEY=V1,V2", "e.g. microbatches=2,4,8")
            key, raw = (s.strip() for s in item.split("=", 1))
            if key not in KEYS:
                raise ConfigError("--space", f"unknown key {key!r}", "valid: " + ", ".join(KEYS))
            try:
                values[key] = [KEYS[key](v.strip()) for v in raw.split(",") if v.strip()]
            except ValueError:
                raise ConfigError("--space", f"{key}={raw!r} has a value that is not a {KEYS[key].__name__}") from None
            if not values[key]:
                raise ConfigError("--space", f"{key} has no values")
        for key, valid in (("schedule", SCHEDULES), ("recompute", RECOMPUTE), ("zero", (0, 1, 2, 3))):
            bad = [v for v in values.get(key, []) if v not in valid]
            if bad:
                raise ConfigError("--space", f"{key}={bad[0]} is not valid", "valid: " + ", ".join(map(str, valid)))
        t, p = cfg.train, cfg.parallel
        values.setdefault("microbatches", [max(1, t.global_batch // (max(1, p.dp) * t.micro_batch))])
        values.setdefault("schedule", [p.schedule])
        values.setdefault("zero", [p.zero])
        values.setdefault("recompute", [t.recompute])
        values.setdefault("sp", [p.sp])
        values.setdefault("cp", [p.cp])
        space = cls(world, values)
        space._enumerate(cfg)
        return space

    def _degrees(self) -> list[tuple[int, int, int, int]]:
        """(dp, tp, pp, cp) with product the world, within the allowed values."""
        divisors = [d for d in range(1, self.world + 1) if self.world % d == 0]
        out = []
        for dp, tp, cp in itertools.product(divisors, divisors, self.values["cp"]):
            if self.world % (dp * tp * cp):
                continue
            pp = self.world // (dp * tp * cp)
            picks = {"dp": dp, "tp": tp, "pp": pp}
            if all(picks[k] in self.values[k] for k in ("dp", "tp", "pp") if k in self.values):
                out.append((dp, tp, pp, cp))
        return out

    def _enumerate(self, cfg: Config) -> None:
        v = self.values
        triples = self._degrees()
        others = [v["microbatches"], v["schedule"], v["zero"], v["recompute"], v["sp"]]
        self.nominal = len(triples) * len(list(itertools.product(*others)))
        seen = set()
        for (dp, tp, pp, cp), (m, schedule, zero, recompute, sp) in itertools.product(
            triples, itertools.product(*others)
        ):
            # Knobs that cannot matter collapse onto one candidate (schedule at pp 1, ZeRO at dp 1, SP at tp 1).
            schedule = "1f1b" if pp == 1 else schedule
            zero = 0 if dp == 1 else zero
            sp = False if tp == 1 else sp
            gb = cfg.train.global_batch
            vpp = _vpp(cfg.model.layers, pp) if schedule == "interleaved" else 1
            layout = Layout(
                tp=tp, pp=pp, dp=dp, vpp=vpp or 0, mbs=max(1, gb // (dp * m)), schedule=schedule, zero=zero, sp=sp,
                recompute=recompute, ep=cfg.parallel.ep, cp=cp,
            )  # fmt: skip
            cand = Candidate(layout, m)
            if cand.name in seen:
                continue
            seen.add(cand.name)
            if gb % (dp * m):
                self.refused.append((cand.name, f"global batch {gb} does not split into dp={dp} x {m} micro-batches"))
                continue
            if vpp is None:
                self.refused.append(
                    (cand.name, f"{cfg.model.layers} layers over pp={pp} leave no vpp >= 2 to interleave")
                )
                continue
            why = structural_reason(cfg.model, layout, gb, self.world, True, self.world)
            if why is None:
                why = trainer_refusal(cfg, layout, self.world)
            else:
                why = why[1]
            if why:
                self.refused.append((cand.name, why))
            else:
                self.candidates.append(cand)
        if not self.candidates:
            first = self.refused[0][1] if self.refused else "the space is empty"
            raise UserError(f"tune: no candidate of the space can run ({first})")


def _vpp(layers: int, pp: int) -> int | None:
    """The fewest model chunks >= 2 that split the layers evenly over pp ranks."""
    per_stage, rest = divmod(layers, pp)
    if rest:
        return None
    return next((v for v in range(2, per_stage + 1) if per_stage % v == 0), None)


def trial_config(cfg: Config, layout: Layout) -> Config:
    """`cfg` running `layout` (on the device the config names)."""
    from threefold.planner.emit import layout_config

    out = layout_config(
        cfg,
        layout,
        cfg.parallel.devices_per_node,
        cfg.parallel.allow_tp_across_nodes,
        cfg.train.device,
        cfg.train.dtype,
    )
    out.train.device = cfg.train.device
    out.parallel.cp = layout.cp
    return out


def trainer_refusal(cfg: Config, layout: Layout, world: int) -> str | None:
    """The trainer's own one-line refusal of `cfg` running `layout`, or None if it would start."""
    from threefold.validate import validate

    try:
        validate(trial_config(cfg, layout), world)
    except UserError as err:
        return str(err)
    return None
