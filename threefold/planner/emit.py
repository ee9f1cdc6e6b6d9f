"""The chosen layout as a TOML config that `threefold train --config FILE` reads.

Every [model] shape key (the expert keys too, for an MoE model) and the layout keys of
[parallel] (ep, cp and cp_impl included) and [train] are written; other keys
only where they differ from the defaults (so a --config given to plan carries through). The
recommended checkpoint interval is written when the config has a checkpoint.dir, else noted
in the header.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from threefold.config import Config
from threefold.planner.layout import Layout
from threefold.planner.model import MOE_KEYS, SHAPE_KEYS

_ALWAYS = {
    "model": SHAPE_KEYS,
    "parallel": (
        "dp",
        "tp",
        "pp",
        "cp",
        "cp_impl",
        "sp",
        "zero",
        "zero3_prefetch",
        "ep",
        "vpp",
        "schedule",
        "devices_per_node",
        "allow_tp_across_nodes",
    ),
    "train": ("global_batch", "micro_batch", "recompute", "dtype", "device"),
}


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are valid TOML


def layout_config(
    cfg: Config,
    layout: Layout,
    devices_per_node: int,
    allow_tp_across_nodes: bool,
    device: str,
    dtype: str,
    checkpoint_interval: int = 0,
) -> Config:
    """A copy of `cfg` running `layout`."""
    out = Config.from_dict(cfg.to_dict())
    p, t = out.parallel, out.train
    p.dp, p.tp, p.pp, p.sp, p.zero, p.ep = layout.dp, layout.tp, layout.pp, layout.sp, layout.zero, layout.ep
    p.vpp, p.schedule = layout.vpp, layout.schedule
    p.cp, p.cp_impl = layout.cp, layout.cp_impl
    p.zero3_prefetch = layout.zero3_prefetch
    p.microbatches = 0  # let train derive it from global_batch / (dp * micro_batch)
    p.devices_per_node, p.allow_tp_across_nodes = devices_per_node, allow_tp_across_nodes
    t.micro_batch, t.recompute = layout.mbs, layout.recompute
    t.dtype = dtype
    t.device = "cpu" if device == "cpu" else "cuda"
    if checkpoint_interval and out.checkpoint.dir:  # an interval without a directory is refused by train
        out.checkpoint.interval = checkpoint_interval
    return out


def config_toml(cfg: Config, header: str = "") -> str:
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    defaults = Config()
    for section in dataclasses.fields(Config):
        name = section.name
        current, default = getattr(cfg, name), getattr(defaults, name)
        body = []
        for f in dataclasses.fields(current):
            value = getattr(current, f.name)
            moe = name == "model" and cfg.model.num_experts and f.name in MOE_KEYS
            if f.name in _ALWAYS.get(name, ()) or moe or value != getattr(default, f.name):
                body.append(f"{f.name} = {toml_value(value)}")
        if body:
            lines += ["", f"[{name}]", *body]
    return "\n".join(lines).lstrip("\n") + "\n"


def write_config(path: str, cfg: Config, header: str = "") -> Path:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(config_toml(cfg, header), encoding="utf-8")
    return p
