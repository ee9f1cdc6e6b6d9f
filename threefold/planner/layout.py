"""A candidate layout, its text form (`tp=8,pp=16,dp=15,vpp=3,mbs=1,zero=1,sp=true,recompute=selective`),
and the structural rules that rule one out, each as a sentence a user understands.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from threefold.errors import ConfigError

SCHEDULES = ("1f1b", "interleaved", "zb", "gpipe")
RECOMPUTE = ("none", "selective", "full")
CP_IMPLS = ("ring", "a2a")


@dataclass(frozen=True)
class Layout:
    """One way to run the model: degrees, micro-batch size, schedule, memory savers."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    mbs: int = 1
    schedule: str = "1f1b"
    zero: int = 0
    sp: bool = False
    recompute: str = "none"
    ep: int = 1
    cp: int = 1
    """Context parallelism: each sequence split over cp ranks (their own devices, beside dp)."""
    cp_impl: str = "ring"
    """Context-parallel attention: ring (KV blocks rotate) or a2a (Ulysses all-to-all over heads)."""
    zero3_prefetch: int = 1
    """ZeRO 3: blocks gathered ahead (parallel.zero3_prefetch): prefetch + 1 blocks whole at once."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mbs)

    def spec(self) -> str:
        """The --layout text that gives this layout back (cp and cp_impl only when cp is used,
        zero3_prefetch only when ZeRO 3 gathers more than one block ahead)."""
        fields = [
            f
            for f in dataclasses.fields(self)
            if (f.name not in ("cp", "cp_impl") or self.cp > 1)
            and (f.name != "zero3_prefetch" or (self.zero == 3 and self.zero3_prefetch != 1))
        ]
        parts = [f"{f.name}={_text(getattr(self, f.name))}" for f in fields]
        return ",".join(parts)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


_KEYS = {f.name: f for f in dataclasses.fields(Layout)}


def parse_layout(text: str, world: int) -> Layout:
    """`tp=8,pp=16,...`: missing keys take their defaults; dp defaults to the rest of the cluster;
    schedule defaults to interleaved when vpp > 1."""
    values: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        if "=" not in item:
            raise ConfigError("--layout", f"{item!r} is not key=value", "e.g. tp=8,pp=4,mbs=1,zero=1")
        key, raw = (s.strip() for s in item.split("=", 1))
        if key == "microbatch" or key == "micro_batch":
            key = "mbs"
        if key not in _KEYS:
            raise ConfigError("--layout", f"unknown key {key!r}", "valid: " + ", ".join(_KEYS))
        kind = _KEYS[key].type
        try:
            if kind in (bool, "bool"):
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                values[key] = raw.lower() in ("true", "1", "yes", "on")
            elif kind in (int, "int"):
                values[key] = int(raw)
            else:
                values[key] = raw
        except ValueError:
            name = kind if isinstance(kind, str) else kind.__name__
            raise ConfigError("--layout", f"{key}={raw!r} is not a valid {name}") from None
    for key in ("tp", "pp", "vpp", "mbs", "ep", "cp", "zero3_prefetch"):
        if values.get(key, 1) < 1:
            raise ConfigError("--layout", f"{key} must be >= 1, got {values[key]}")
    if "dp" not in values:
        inner = values.get("tp", 1) * values.get("pp", 1) * values.get("cp", 1)
        if world % inner:
            raise ConfigError(
                "--layout", f"tp*pp*cp = {inner} does not divide the cluster's {world} devices", "give dp= explicitly"
            )
        values["dp"] = world // inner
    if values["dp"] < 1:
        raise ConfigError("--layout", f"dp must be >= 1, got {values['dp']}")
    if "schedule" not in values:
        values["schedule"] = "interleaved" if values.get("vpp", 1) > 1 else "1f1b"
    if values["schedule"] not in SCHEDULES:
        raise ConfigError("--layout", f"schedule {values['schedule']!r} is unknown", "valid: " + ", ".join(SCHEDULES))
    if values.get("recompute", "none") not in RECOMPUTE:
        raise ConfigError("--layout", f"recompute {values['recompute']!r} is unknown", "valid: " + ", ".join(RECOMPUTE))
    if values.get("cp_impl", "ring") not in CP_IMPLS:
        raise ConfigError("--layout", f"cp_impl {values['cp_impl']!r} is unknown", "valid: " + ", ".join(CP_IMPLS))
    if values.get("zero", 0) not in (0, 1, 2, 3):
        raise ConfigError("--layout", f"zero {values['zero']} is not a ZeRO stage", "valid: 0, 1, 2, 3")
    return Layout(**values)


# ----------------------------------------------------------------------------- rules
# Each returns None when the layout passes, else (kind, sentence). Kinds group the rejections
# in the report; sentences name the numbers so a user can see what to change.


def tp_reason(model, tp: int, devices_per_node: int, allow_across: bool) -> tuple[str, str] | None:
    if tp == 1:
        return None
    if model.heads % tp:
        return "tp-shape", f"tp={tp} cannot split the model's {model.heads} attention heads evenly."
    if model.kv_heads % tp and tp % model.kv_heads:
        return "tp-shape", (
            f"tp={tp} and the model's {model.kv_heads} key/value heads do not divide one another, "
            "so they cannot be split or shared evenly."
        )
    if model.ffn_hidden % tp:
        return "tp-shape", f"tp={tp} cannot split the MLP width {model.ffn_hidden} evenly."
    if model.vocab % tp:
        return "tp-shape", f"tp={tp} cannot split the vocabulary of {model.vocab} evenly (pad model.vocab)."
    if getattr(model, "num_experts", 0) and model.seq_len % tp:
        return "tp-shape", (
            f"tp={tp} cannot split the sequence of {model.seq_len} tokens evenly, which the MoE "
            "layers need: their tensor-parallel ranks route a slice of the tokens each."
        )
    if tp > devices_per_node and not allow_across:
        return "tp-across-nodes", (
            f"tp={tp} would stretch a tensor-parallel group across nodes of {devices_per_node} "
            "devices, over the slow inter-node link (--cluster.allow_tp_across_nodes true "
            "allows it)."
        )
    if devices_per_node % tp and tp < devices_per_node and not allow_across:
        return "tp-across-nodes", (
            f"tp={tp} does not divide the {devices_per_node} devices of a node, so some "
            "tensor-parallel groups would straddle two nodes."
        )
    return None


def pp_reason(model, pp: int, vpp: int) -> tuple[str, str] | None:
    if pp * vpp > model.layers:
        what = f"pp={pp}" + (f" x vpp={vpp}" if vpp > 1 else "")
        return "pp-shape", f"{what} needs {pp * vpp} pipeline stages but the model has only {model.layers} layers."
    return None


def batch_reason(global_batch: int, dp: int, mbs: int | None = None) -> tuple[str, str] | None:
    if global_batch % dp:
        return "batch", (
            f"the global batch of {global_batch} sequences does not split evenly over dp={dp} data-parallel ranks."
        )
    if mbs is not None and (global_batch // dp) % mbs:
        return "batch", (
            f"each data-parallel rank gets {global_batch // dp} sequences, not a multiple of the "
            f"micro-batch size {mbs}."
        )
    return None


def schedule_reason(schedule: str, p: int, m: int, v: int, prune: bool = True) -> tuple[str, str] | None:
    """What the schedule cannot run; with `prune`, also what the search leaves out though it runs
    (fewer micro-batches than stages: predicting a run that did so needs prune=False)."""
    if p == 1:
        if schedule not in ("1f1b",) or v != 1:
            return "schedule", f"schedule {schedule} with vpp={v} needs pipeline parallelism (pp > 1)."
        return None
    if schedule == "interleaved":
        if v < 2:
            return "schedule", "the interleaved schedule needs vpp >= 2 model chunks per pipeline rank."
        if m % p:
            return "microbatches", (
                f"the interleaved schedule needs the micro-batch count ({m}) to be a multiple of pp={p}."
            )
    elif v != 1:
        return "schedule", f"vpp={v} needs the interleaved schedule; {schedule} runs one chunk per rank."
    if prune and m < p:
        return "microbatches", (
            f"{m} micro-batch{'es' if m != 1 else ''} cannot fill {p} pipeline stages: most "
            f"stages would sit idle (use at least {p}, i.e. a smaller micro-batch or dp)."
        )
    return None


def feature_reason(model, layout: Layout) -> tuple[str, str] | None:
    if layout.sp and layout.tp == 1:
        return "sp", "sequence parallelism needs tensor parallelism (tp > 1)."
    why = cp_reason(model, layout.cp, layout.cp_impl, layout.tp)
    if why:
        return why
    if layout.sp and (model.seq_len // layout.cp) % layout.tp:
        seq = model.seq_len // layout.cp
        return "sp", f"sequence parallelism needs each cp rank's {seq} tokens to split evenly over tp={layout.tp}."
    why = ep_reason(model, layout.ep, layout.dp)
    if why:
        return why
    if layout.zero and layout.dp * layout.cp == 1:
        return "zero", f"ZeRO stage {layout.zero} shards over data-parallel ranks, and dp=1 has none to shard over."
    return None


def cp_reason(model, cp: int, impl: str, tp: int) -> tuple[str, str] | None:
    """What validate.py refuses for parallel.cp, as the planner's sentences."""
    if cp == 1:
        return None
    if ":" in getattr(model, "arch", ""):
        return "cp", f"cp={cp}: a user model's attention is its own, so context parallelism cannot split it."
    if model.seq_len % (2 * cp):
        return "cp", (
            f"cp={cp} cuts each sequence into 2*cp = {2 * cp} equal chunks (two per rank), "
            f"but seq_len {model.seq_len} is not a multiple of {2 * cp}."
        )
    if getattr(model, "num_experts", 0) and getattr(model, "capacity_factor", 0):
        return "cp", f"cp={cp} needs dropless routing (model.capacity_factor 0) in the MoE layers."
    if impl == "a2a":
        for name in ("heads", "kv_heads"):
            local = max(1, getattr(model, name) // tp)
            if local % cp:
                return "cp", (
                    f"cp={cp} with a2a splits each tp rank's {local} {name.replace('_', ' ')} over cp ranks, "
                    "which needs them divisible by cp (ring has no such rule)."
                )
    return None


def ep_reason(model, ep: int, dp: int) -> tuple[str, str] | None:
    experts = getattr(model, "num_experts", 0)
    if ep == 1:
        return None
    if not experts:
        return "ep", f"ep={ep}: the model has no experts to place, so expert parallelism must be 1."
    if experts % ep:
        return "ep", (
            f"ep={ep} cannot split the model's {experts} experts evenly: each expert-parallel rank "
            "holds an equal share."
        )
    if dp % ep:
        return "ep", (
            f"ep={ep} does not divide dp={dp}: expert-parallel ranks are carved out of the data-parallel ones."
        )
    return None


def structural_reason(
    model_cfg,
    layout: Layout,
    global_batch: int,
    devices_per_node: int,
    allow_across: bool,
    world: int,
    prune: bool = True,
) -> tuple[str, str] | None:
    """Every rule for one given layout (the search applies them level by level instead); `prune`
    as in schedule_reason."""
    if layout.world > world:
        return "devices", f"the layout needs {layout.world} devices but the cluster has {world}."
    for reason in (
        tp_reason(model_cfg, layout.tp, devices_per_node, allow_across),
        pp_reason(model_cfg, layout.pp, layout.vpp),
        batch_reason(global_batch, layout.dp, layout.mbs),
        feature_reason(model_cfg, layout),
    ):
        if reason:
            return reason
    return schedule_reason(layout.schedule, layout.pp, layout.microbatches(global_batch), layout.vpp, prune)
