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
from collections.abc import Iterator
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
    "placement": "does not place on the topology",
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
    admit=None,
) -> Plan:
    """Every layout of the cluster's devices for the model and batch; the `keep` fastest that fit.
    `admit(layout)`: None, or (kind, sentence) rejecting it before it is priced (e.g. the layouts a
    topology cannot place), so the `keep` fastest are of those it admits."""
    t0 = time.perf_counter()
    space = _LayoutSpace(shape.cfg, cluster, global_batch, pins)
    usable = cluster.usable_bytes
    fits: list[tuple] = []
    for layout in space.layouts():
        if admit is not None and (why := admit(layout)):
            space.reject(why[0], layout.as_dict(), why[1])
            continue
        mem = device_memory(shape, layout, global_batch, dtype, cluster.keeps_attention_scores)
        if mem.total > usable:
            space.reject("memory", layout.as_dict(), oom_sentence(mem, usable, cluster), score=-mem.total)
            continue
        pred = predict(shape, cluster, layout, global_batch, dtype, memory=mem)
        fits.append(((pred.step_time_s, complexity(layout), mem.total), space.considered, pred))
    ranked = _fastest_distinct(fits, keep)
    return Plan(shape, cluster, global_batch, dtype, ranked, space.rejected, space.considered, time.perf_counter() - t0)


def _fastest_distinct(fits: list[tuple], keep: int) -> list[Prediction]:
    """The `keep` fastest of (sort key, order considered, prediction); variants that differ only
    in ZeRO stage and predict the same time are listed once, at the lowest stage."""
    fits.sort(key=lambda item: item[:2])
    ranked, seen = [], set()
    for _, _, pred in fits:
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
    return ranked


class _LayoutSpace:
    """The layouts of a cluster's devices for one model and batch, enumerated degree by degree
    (tp and cp, pp and dp, ep, micro-batch and schedule, then the switches). A rule that fails
    for a degree rejects every layout under it at once, with one sentence, into `rejected`;
    `considered` counts the complete layouts built."""

    def __init__(self, cfg, cluster: Cluster, global_batch: int, pins: dict | None):
        self.cfg, self.cluster, self.global_batch = cfg, cluster, global_batch
        self.pins = dict(pins or {})
        self.experts = getattr(cfg, "num_experts", 0)
        self.rejected: dict[str, Rejected] = {}
        self.considered = 0

    def reject(self, kind: str, partial: dict, sentence: str, score: float = 0.0) -> None:
        plain = partial.get("cp", 1) == 1  # cp keys only where cp is used, as Layout.spec writes them
        items = [(k, v) for k, v in partial.items() if not (plain and k in ("cp", "cp_impl"))]
        spec = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in items)
        self.rejected.setdefault(kind, Rejected(kind)).add(spec, sentence, score)

    def layouts(self) -> Iterator[Layout]:
        """Every complete layout no rule rejects, in the search's order (memory is the caller's)."""
        pins = self.pins
        if "ep" in pins and pins["ep"] != 1 and not self.experts:
            sentence = f"ep={pins['ep']}: the model has no experts to place, so expert parallelism must be 1."
            self.reject("ep", {"ep": pins["ep"]}, sentence)
            pins["ep"] = 1
        for tp, cp, impls in self._tp_cp_impls():
            for pp, dp in self._pp_dp(tp, cp):
                eps = self._eps(tp, pp, dp)
                if not eps:
                    continue
                for mbs, schedule, vpp in self._batches_and_schedules(tp, pp, dp):
                    base = {"tp": tp, "pp": pp, "dp": dp, "mbs": mbs, "schedule": schedule, "vpp": vpp, "cp": cp}
                    yield from self._variants(base, eps, impls)

    def _tp_cp_impls(self) -> Iterator[tuple[int, int, list[str]]]:
        """(tp, cp, the context-parallel attentions the rules allow) for each tp fitting the node
        (or the cluster) and the model's heads, and each cp the sequence allows."""
        cfg, cluster = self.cfg, self.cluster
        tp_pool = [t for t in _divisors(cluster.world) if t <= cfg.heads]
        long_seq = cluster.cp_min_seq > 0 and cfg.seq_len >= cluster.cp_min_seq
        for tp, cp in _tp_cp(self.pins, tp_pool, cluster.world, cfg.seq_len, long_seq):
            why = tp_reason(cfg, tp, cluster.devices_per_node, cluster.allow_tp_across_nodes)
            if why:
                self.reject(why[0], {"tp": tp}, why[1])
                continue
            impls = []
            for impl in _allowed(self.pins, "cp_impl", ("ring", "a2a") if cp > 1 else ("ring",)):
                why = cp_reason(cfg, cp, impl, tp)
                if why:
                    self.reject(why[0], {"tp": tp, "cp": cp, "cp_impl": impl}, why[1])
                else:
                    impls.append(impl)
            if impls:
                yield tp, cp, impls

    def _pp_dp(self, tp: int, cp: int) -> Iterator[tuple[int, int]]:
        """(pp, dp) over what tp x cp leaves of the cluster, dp the rest unless pinned, while the
        global batch splits over dp."""
        world = self.cluster.world
        rest = world // (tp * cp) if world % (tp * cp) == 0 else 0
        if not rest:
            what = f"tp={tp} x cp={cp} = {tp * cp}" if cp > 1 else f"tp={tp}"
            self.reject("devices", {"tp": tp, "cp": cp}, f"{what} does not divide the cluster's {world} devices.")
            return
        for pp in _allowed(self.pins, "pp", [p for p in _divisors(rest) if p <= self.cfg.layers]):
            why = pp_reason(self.cfg, pp, 1)
            if why:
                self.reject(why[0], {"tp": tp, "cp": cp, "pp": pp}, why[1])
                continue
            inner = tp * cp * pp
            dp = self.pins.get("dp", world // inner if world % inner == 0 else 0)
            what = f"tp={tp} x pp={pp}" + (f" x cp={cp}" if cp > 1 else "")
            if dp < 1:
                sentence = f"{what} = {inner} does not divide the cluster's {world} devices."
                self.reject("devices", {"tp": tp, "cp": cp, "pp": pp}, sentence)
                continue
            if inner * dp > world:
                sentence = f"{what} x dp={dp} needs {inner * dp} devices but the cluster has {world}."
                self.reject("devices", {"tp": tp, "cp": cp, "pp": pp, "dp": dp}, sentence)
                continue
            why = batch_reason(self.global_batch, dp)
            if why:
                self.reject(why[0], {"tp": tp, "pp": pp, "dp": dp}, why[1])
                continue
            yield pp, dp

    def _eps(self, tp: int, pp: int, dp: int) -> list[int]:
        """The expert-parallel degrees the rules allow: divisors of dp that divide the experts (1 when dense)."""
        eps = []
        pool = [e for e in _divisors(dp) if self.experts and self.experts % e == 0] or [1]
        for ep in _allowed(self.pins, "ep", pool):
            why = ep_reason(self.cfg, ep, dp)
            if why:
                self.reject(why[0], {"tp": tp, "pp": pp, "dp": dp, "ep": ep}, why[1])
            else:
                eps.append(ep)
        return eps

    def _batches_and_schedules(self, tp: int, pp: int, dp: int) -> Iterator[tuple[int, str, int]]:
        """(micro-batch size, schedule, vpp) for each micro-batch size dividing a rank's share of
        the batch and each schedule that applies to its micro-batch count."""
        per_rank = self.global_batch // dp
        for mbs in _allowed(self.pins, "mbs", [b for b in MBS_CHOICES if per_rank % b == 0]):
            why = batch_reason(self.global_batch, dp, mbs)
            if why:
                self.reject(why[0], {"tp": tp, "pp": pp, "dp": dp, "mbs": mbs}, why[1])
                continue
            for schedule, vpp in _schedules(self.cfg, pp, self.pins):
                why = schedule_reason(schedule, pp, per_rank // mbs, vpp) or pp_reason(self.cfg, pp, vpp)
                if why:
                    base = {"tp": tp, "pp": pp, "dp": dp, "mbs": mbs, "schedule": schedule, "vpp": vpp}
                    self.reject(why[0], base, why[1])
                    continue
                yield mbs, schedule, vpp

    def _variants(self, base: dict, eps: list[int], impls: list[str]) -> Iterator[Layout]:
        """Each ZeRO stage (with dp x cp > 1), SP (with tp > 1), recompute, ep and cp attention of
        the degrees in `base`, the feature rules applied."""
        zeros = (0, 1, 2, 3) if base["dp"] * base["cp"] > 1 else (0,)
        prefetch = self.pins.get("zero3_prefetch", 1)  # not searched: it trades memory, not time
        for zero in _allowed(self.pins, "zero", zeros):
            for sp in _allowed(self.pins, "sp", (False, True) if base["tp"] > 1 else (False,)):
                recomputes = _allowed(self.pins, "recompute", RECOMPUTE)
                for recompute, ep, impl in itertools.product(recomputes, eps, impls):
                    layout = Layout(
                        **base, zero=zero, sp=sp, recompute=recompute, ep=ep, cp_impl=impl, zero3_prefetch=prefetch
                    )
                    self.considered += 1
                    why = feature_reason(self.cfg, layout)
                    if why:
                        self.reject(why[0], layout.as_dict(), why[1])
                        continue
                    yield layout


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
