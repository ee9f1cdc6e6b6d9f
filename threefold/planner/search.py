"""Enumerate layouts, predict each, rank the ones that fit, and say why the others do not.

The space is pruned where the answer is known without predicting: degrees are divisors (tp of
the node size, or of the world when TP may cross nodes; pp of what tp leaves; dp is the rest),
micro-batch sizes come from {1, 2, 4, 8, 16, 32}, vpp from the divisors 2..8 of the layers per
stage, ZeRO only when dp > 1, SP only when tp > 1, ep over the divisors of dp that divide the
experts (mixture-of-experts models; ep = 1 for dense ones).

Context parallelism is searched only for long sequences, seq_len >= cluster.cp_min_seq (8192
by default; 0 turns it off), or when --parallel.cp pins it: below ~8k tokens a sequence's
activations fit once TP, SP and recompute are used, and cp's KV traffic and smaller per-rank
GEMMs cost more than they give (Megatron-Core's guidance; Llama 3 used cp only for its 128k
stage). cp runs over the divisors of what tp leaves with seq_len % (2 cp) == 0, each with ring
and, where the TP-local heads divide, a2a (--parallel.cp_impl pins one).
A rule that fails for a degree rejects every layout under it at once, with one sentence.
Memory is checked before time, so layouts that do not fit cost almost nothing.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from threefold.planner.cluster import Cluster, GiB
from threefold.planner.layout import (
    RECOMPUTE,
    SCHEDULES,
    Layout,
    batch_reason,
    cp_reason,
    ep_reason,
    feature_reason,
    pp_reason,
    schedule_reason,
    tp_reason,
)
from threefold.planner.memory import Memory, device_memory
from threefold.planner.model import ModelShape
from threefold.planner.predict import Prediction, predict

MBS_CHOICES = (1, 2, 4, 8, 16, 32)
VPP_CHOICES = range(2, 9)
KIND_TITLES = {
    "memory": "out of memory",
    "tp-across-nodes": "tensor parallelism across nodes",
    "tp-shape": "model shape does not split over tp",
    "pp-shape": "more pipeline stages than layers",
    "batch": "global batch does not split",
    "microbatches": "too few micro-batches for the schedule",
    "schedule": "schedule does not apply",
    "sp": "sequence parallelism does not apply",
    "zero": "ZeRO does not apply",
    "ep": "expert parallelism does not apply",
    "cp": "context parallelism does not apply",
    "devices": "more devices than the cluster has",
}


def oom_sentence(memory: Memory, usable: float, cluster: Cluster) -> str:
    g = lambda x: f"{x / GiB:.1f}"  # noqa: E731
    parts = (
        f"params {g(memory.params)} + grads {g(memory.grads)} + optimizer {g(memory.optimizer)} + "
        f"activations {g(memory.activations)} GiB for {memory.inflight:g} micro-batch"
        f"{'' if memory.inflight == 1 else 'es'} in flight"
    )
    if memory.buffers:
        parts += f" + buffers {g(memory.buffers)}"
    if memory.expert_state:
        parts += f"; the experts' state is {g(memory.expert_state)} GiB of it"
    return (
        f"out of memory: needs {g(memory.total)} GiB per device ({parts}) but each {cluster.device} "
        f"has {g(usable)} GiB usable."
    )


@dataclass
class Rejected:
    """Layouts ruled out for one kind of reason: how many, and the closest few."""

    kind: str
    count: int = 0
    examples: list = field(default_factory=list)  # min-heap of (closeness, -order, spec, sentence)

    def add(self, spec: str, sentence: str, score: float = 0.0, keep: int = 3) -> None:
        self.count += 1
        item = (score, -self.count, spec, sentence)  # keep the highest scores, then the earliest
        if len(self.examples) < keep:
            heapq.heappush(self.examples, item)
        elif item > self.examples[0]:
            heapq.heapreplace(self.examples, item)

    def best(self) -> list[tuple[str, str]]:
        return [(spec, sentence) for _, _, spec, sentence in sorted(self.examples, reverse=True)]

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "title": KIND_TITLES.get(self.kind, self.kind),
            "count": self.count,
            "examples": [{"layout": spec, "reason": sentence} for spec, sentence in self.best()],
        }


@dataclass
class Plan:
    shape: ModelShape
    cluster: Cluster
    global_batch: int
    dtype: str
    ranked: list[Prediction]
    rejected: dict[str, Rejected]
    considered: int
    search_s: float

    @property
    def best(self) -> Prediction | None:
        return self.ranked[0] if self.ranked else None

    def rejected_count(self) -> int:
        return sum(r.count for r in self.rejected.values())


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _allowed(pins: dict, key: str, values) -> list:
    if key in pins:
        return [pins[key]]
    return list(values)


def complexity(layout: Layout) -> tuple:
    """Ties in time go to the simpler layout: less cp, ZeRO, SP, recompute, interleaving, ep."""
    return (
        layout.cp,
        layout.zero,
        layout.sp,
        RECOMPUTE.index(layout.recompute),
        layout.vpp,
        SCHEDULES.index(layout.schedule),
        layout.ep,
    )


def search(
    shape: ModelShape,
    cluster: Cluster,
    global_batch: int,
    dtype: str = "bf16",
    pins: dict | None = None,
    keep: int = 50,
) -> Plan:
    """Every layout of the cluster's devices for the model and batch; the `keep` fastest that fit."""
    t0 = time.perf_counter()
    pins = dict(pins or {})
    cfg = shape.cfg
    world, dpn = cluster.world, cluster.devices_per_node
    rejected: dict[str, Rejected] = {}
    fits: list[tuple] = []
    considered = 0
    usable = cluster.usable_bytes

    def reject(kind: str, partial: dict, sentence: str, score: float = 0.0) -> None:
        plain = partial.get("cp", 1) == 1  # cp keys only where cp is used, as Layout.spec writes them
        items = [(k, v) for k, v in partial.items() if not (plain and k in ("cp", "cp_impl"))]
        spec = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in items)
        rejected.setdefault(kind, Rejected(kind)).add(spec, sentence, score)

    experts = getattr(cfg, "num_experts", 0)
    if "ep" in pins and pins["ep"] != 1 and not experts:
        reject(
            "ep",
            {"ep": pins["ep"]},
            f"ep={pins['ep']}: the model has no experts to place, so expert parallelism must be 1.",
        )
        pins["ep"] = 1
    tp_pool = [t for t in _divisors(world) if t <= cfg.heads]
    long_seq = cluster.cp_min_seq > 0 and cfg.seq_len >= cluster.cp_min_seq
    for tp, cp in _tp_cp(pins, tp_pool, world, cfg.seq_len, long_seq):
        why = tp_reason(cfg, tp, dpn, cluster.allow_tp_across_nodes)
        if why:
            reject(why[0], {"tp": tp}, why[1])
            continue
        impls = []
        for impl in _allowed(pins, "cp_impl", ("ring", "a2a") if cp > 1 else ("ring",)):
            why = cp_reason(cfg, cp, impl, tp)
            if why:
                reject(why[0], {"tp": tp, "cp": cp, "cp_impl": impl}, why[1])
            else:
                impls.append(impl)
        if not impls:
            continue
        rest = world // (tp * cp) if world % (tp * cp) == 0 else 0
        if not rest:
            what = f"tp={tp} x cp={cp} = {tp * cp}" if cp > 1 else f"tp={tp}"
            sentence = f"{what} does not divide the cluster's {world} devices."
            reject("devices", {"tp": tp, "cp": cp}, sentence)
            continue
        pp_pool = [p for p in _divisors(rest) if p <= cfg.layers]
        for pp in _allowed(pins, "pp", pp_pool):
            why = pp_reason(cfg, pp, 1)
            if why:
                reject(why[0], {"tp": tp, "cp": cp, "pp": pp}, why[1])
                continue
            inner = tp * cp * pp
            dp = pins.get("dp", world // inner if world % inner == 0 else 0)
            what = f"tp={tp} x pp={pp}" + (f" x cp={cp}" if cp > 1 else "")
            if dp < 1:
                sentence = f"{what} = {inner} does not divide the cluster's {world} devices."
                reject("devices", {"tp": tp, "cp": cp, "pp": pp}, sentence)
                continue
            if inner * dp > world:
                reject(
                    "devices",
                    {"tp": tp, "cp": cp, "pp": pp, "dp": dp},
                    f"{what} x dp={dp} needs {inner * dp} devices but the cluster has {world}.",
                )
                continue
            why = batch_reason(global_batch, dp)
            if why:
                reject(why[0], {"tp": tp, "pp": pp, "dp": dp}, why[1])
                continue
            ep_pool = []
            for ep in _allowed(pins, "ep", [e for e in _divisors(dp) if experts and experts % e == 0] or [1]):
                why = ep_reason(cfg, ep, dp)
                if why:
                    reject(why[0], {"tp": tp, "pp": pp, "dp": dp, "ep": ep}, why[1])
                else:
                    ep_pool.append(ep)
            if not ep_pool:
                continue
            per_rank = global_batch // dp
            mbs_pool = [b for b in MBS_CHOICES if per_rank % b == 0]
            for mbs in _allowed(pins, "mbs", mbs_pool):
                why = batch_reason(global_batch, dp, mbs)
                if why:
                    reject(why[0], {"tp": tp, "pp": pp, "dp": dp, "mbs": mbs}, why[1])
                    continue
                m = per_rank // mbs
                for schedule, vpp in _schedules(cfg, pp, pins):
                    base = {"tp": tp, "pp": pp, "dp": dp, "mbs": mbs, "schedule": schedule, "vpp": vpp}
                    why = schedule_reason(schedule, pp, m, vpp) or pp_reason(cfg, pp, vpp)
                    if why:
                        reject(why[0], base, why[1])
                        continue
                    for zero in _allowed(pins, "zero", (0, 1, 2, 3) if dp * cp > 1 else (0,)):
                        for sp in _allowed(pins, "sp", (False, True) if tp > 1 else (False,)):
                            recomputes = _allowed(pins, "recompute", RECOMPUTE)
                            for recompute, ep, impl in itertools.product(recomputes, ep_pool, impls):
                                layout = Layout(
                                    tp=tp,
                                    pp=pp,
                                    dp=dp,
                                    vpp=vpp,
                                    mbs=mbs,
                                    schedule=schedule,
                                    zero=zero,
                                    sp=sp,
                                    recompute=recompute,
                                    ep=ep,
                                    cp=cp,
                                    cp_impl=impl,
                                )
                                considered += 1
                                why = feature_reason(cfg, layout)
                                if why:
                                    reject(why[0], layout.as_dict(), why[1])
                                    continue
                                mem = device_memory(shape, layout, global_batch, dtype)
                                if mem.total > usable:
                                    reject(
                                        "memory", layout.as_dict(), oom_sentence(mem, usable, cluster), score=-mem.total
                                    )
                                    continue
                                pred = predict(shape, cluster, layout, global_batch, dtype, memory=mem)
                                key = (pred.step_time_s, complexity(layout), mem.total)
                                fits.append((key, considered, pred))
    fits.sort(key=lambda item: item[:2])
    ranked, seen = [], set()
    for _, _, pred in fits:
        # Variants that differ only in ZeRO stage and predict the same time: list the lowest stage.
        lay = pred.layout
        fold = (
            lay.tp,
            lay.pp,
            lay.dp,
            lay.vpp,
            lay.mbs,
            lay.schedule,
            lay.sp,
            lay.recompute,
            lay.ep,
            lay.cp,
            lay.cp_impl,
            round(pred.step_time_s, 9),
        )
        if fold in seen:
            continue
        seen.add(fold)
        ranked.append(pred)
        if len(ranked) >= keep:
            break
    return Plan(shape, cluster, global_batch, dtype, ranked, rejected, considered, time.perf_counter() - t0)


def _tp_cp(pins: dict, tp_pool: list[int], world: int, seq: int, long_seq: bool) -> list[tuple[int, int]]:
    """(tp, cp) pairs: cp = 1 only, unless the sequence is long or cp is pinned; then the
    divisors of world / tp whose 2 cp chunks cut the sequence evenly (a pinned cp as given, for
    the rules to judge)."""
    pairs = []
    for tp in _allowed(pins, "tp", tp_pool):
        if "cp" in pins:
            pairs.append((tp, pins["cp"]))
        elif not long_seq or world % tp:
            pairs.append((tp, 1))
        else:
            pairs += [(tp, cp) for cp in _divisors(world // tp) if seq % (2 * cp) == 0]
    return pairs


def _schedules(cfg, pp: int, pins: dict) -> list[tuple[str, int]]:
    if pp == 1:
        combos = [("1f1b", 1)]
    else:
        layers_per_stage = cfg.layers // pp
        vpps = [v for v in VPP_CHOICES if layers_per_stage % v == 0]
        combos = [(s, 1) for s in SCHEDULES if s != "interleaved"] + [("interleaved", v) for v in vpps]
    if "schedule" in pins or "vpp" in pins:
        sched, vpp = pins.get("schedule"), pins.get("vpp")
        if sched is None:
            sched = "interleaved" if vpp and vpp > 1 else None
        combos = [(s, v) for s, v in combos if (sched is None or s == sched) and (vpp is None or v == vpp)]
        if not combos:  # a pinned combination the pool lacks: let the rules explain it
            sched = sched or ("interleaved" if (vpp or 1) > 1 else "1f1b")
            combos = [(sched, vpp or (2 if sched == "interleaved" else 1))]
    return combos
