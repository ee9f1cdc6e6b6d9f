"""The slow link, told apart from a slow rank and a slow node, named in-run from the ranks' own
communication times.

    clock = LinkClock(groups, names, grid.pp, rank, device)  # every rank, with log.spans on
    clock.end_step(flush)                    # every step: host sums, no communication
    row += clock.take()                      # report steps: O(1) columns, summed since the last
    detector(cfg, grid).on_report(view)      # rank 0, report steps: the findings

Each rank's row (observer.py gathers it to rank 0 on report steps) carries, per group it reports
(observer.GROUPS), the seconds it spent in that group's collectives (in the call, and waiting on
an asynchronous one: post to completion), and for the pipeline the seconds it spent posting to
and waiting on each of its two neighbours (`pp_prev_s`, `pp_next_s`: the previous and next stage's
rank of its own pipeline; virtual stages talk to the same two ranks). That is len(names) + 2
floats per rank whatever the world size.

Rank 0 compares like with like:

- a pipeline pair (stage s, s+1 of one replica) by the wait of BOTH its ends on each other,
  against the median of every other pair's, and each end against the same end of the other pairs
  at its stage: a slow link makes its two ends wait on it; a rank that is slow makes its peers
  wait on it but itself waits on nobody, so a one-ended wait is not a link;
- a collective group (every tp, cp, dp, ep... group of one dimension) by its least-waiting
  member's time: a slow link inside the group delays every member, a slow member is the one
  that waits least;
- a rank by its own time (compute, data wait and the host work between spans: spans.OWN) against
  the median of its stage peers (same pipeline stage: the same layers); a rank that computes
  slowly is named as a slow rank, never as a link, and a node (rank // ranks per node) all of
  whose ranks are slow is named as a slow node instead.

A finding is named when its report window shows it beyond the margin and the window before
showed it beyond half the margin (LOOSE): one window can hold a burst of load, and an attempt's
first window dilutes every difference with the start-up all ranks pay. Its `since` is the first
window of that streak.

Nothing here knows whether a drill runs: a sleep in the comm path, a throttled process or a
bad cable look the same.
"""

from __future__ import annotations

import statistics

import torch

from threefold.distributed.comm import LinkTimes
from threefold.distributed.grid import GROUP_DIMS
from threefold.observe.findings import Finding
from threefold.observe.hops import HOP_DIMS, HOP_NAMES, HopProbe, slow_hops
from threefold.observe.medians import medians_of_others, medians_without

PEER_COLUMNS = ("pp_prev_s", "pp_next_s")
COMPARED = HOP_DIMS
"""Reported group name -> its dimensions in GROUP_DIMS, for the groups compared across their
dimension. The pipeline is compared pair by pair (its collective is the flush, whose time is the
cool-down bubble); "embed" holds the pipeline's two ends (the same links as its pairs) and
"world" has no peer group to be compared with."""
OWN_CATEGORIES = ("forward", "backward", "weight_grad", "recompute", "data_wait", "other")
"""A rank's own work (spans.OWN less a save and evaluation, which not every rank does alike)."""
RATIO = 2.0
"""log.slow_ratio's default: a pipeline pair, a group or a rank is slow above this multiple of its
peers' median. Measured on the 2-core host, tp2 pp2 dp2 (tests/observe/test_slow_link.py): clean
runs' pairs and ranks stay under 1.6x their peers' median; a 20 ms slow link is 3.2-3.9x, a 10 ms
one 2.6-2.8x on a quiet host but 1.8x under other jobs' load; the slow drill's rank is 2.3x and
more at factor 1.5, 3-6x at factors 2 and 3."""
LOOSE = 0.5
"""The share of the margin (ratio - 1) the window before must show a finding by: a slow link or
rank lasts, a burst of load on a shared host rarely does; the first window averages start-up (the
first step's compilation, allocators warming up), which all ranks pay and which dilutes any
difference. With a drill from step 0 a finding is named on the report at 2 x log.interval."""
FLOOR_S = {"cpu": 2e-3, "cuda": 2e-4}
"""Absolute excess per step below which a difference is noise (a shared CPU host jitters by a
millisecond or two per exchange)."""


def pipeline_neighbours(pp_ranks: list[int], me: int) -> tuple[int | None, int | None]:
    """(previous, next) stage's rank of `me` in its pipeline `pp_ranks`. With two stages there is
    one link (0 -> 1): stage 0 has only a next, stage 1 only a previous. With more, the last
    stage's next is the first (the wrap of virtual stages; idle without them)."""
    n, i = len(pp_ranks), pp_ranks.index(me)
    if n < 2:
        return None, None
    if n == 2:
        return (None, pp_ranks[1]) if i == 0 else (pp_ranks[0], None)
    return pp_ranks[(i - 1) % n], pp_ranks[(i + 1) % n]


class LinkClock:
    """This rank's per-group communication seconds, summed on the host step by step (on CUDA the
    device timers are read one step late, where the host has waited for that step anyway; all of
    them on a flush, a report step)."""

    def __init__(self, groups: list, names: tuple[str, ...], pp, me: int, device: torch.device):
        self.names, self.cuda = names, torch.device(device).type == "cuda"
        self._groups = [g if g is not None and g.size > 1 else None for g in groups]
        for group in {id(g): g for g in self._groups if g is not None}.values():
            group.link = LinkTimes(device)
        self.pp = pp if pp is not None and pp.size > 1 else None
        self.prev, self.next = pipeline_neighbours(pp.ranks, me) if self.pp is not None else (None, None)
        self.sums_width = len(names) + len(PEER_COLUMNS)
        self.width = self.sums_width + len(HOP_NAMES)
        self.hops = HopProbe(self._groups, names, device)
        self._pending: list[list] = []
        self._sums = [0.0] * self.sums_width

    @staticmethod
    def detach(grid) -> None:
        """No LinkTimes on any group (spans off; a previous run may have left some)."""
        for group in getattr(grid, "groups", {}).values():
            group.link = None

    def end_step(self, flush: bool) -> None:
        """Close this step's intervals (host only); read the ones the host has waited for."""
        taken, seen = [], set()
        for group in self._groups:
            if group is None or id(group) in seen:
                taken.append(None)
                continue
            seen.add(id(group))
            taken.append(group.link.take())
        self._pending.append(taken)
        ready = self._pending if flush or not self.cuda else self._pending[:-1]
        for step in ready:
            self._add(step)
        self._pending = [] if ready is self._pending else self._pending[-1:]

    def _add(self, taken: list) -> None:
        for i, pair in enumerate(taken):
            if pair is None:
                continue
            collective, peers = pair
            seconds = collective.seconds
            if self._groups[i] is self.pp:
                for j, peer in enumerate((self.prev, self.next)):
                    if peer is not None and peer in peers:
                        self._sums[len(self.names) + j] += peers[peer].seconds
            else:  # a cp ring's exchanges are the group's communication too
                seconds += sum(t.seconds for t in peers.values())
            self._sums[i] += seconds

    def take(self) -> list[float]:
        """The sums since the last take (the row's first sums_width link columns); they start
        again from zero."""
        out, self._sums = self._sums, [0.0] * self.sums_width
        return out

    def probe(self) -> list[float]:
        """This rank's hop round trips (the row's last len(HOP_NAMES) columns; observe/hops.py).
        Collective over each ring group it is in: every rank calls it on the same steps."""
        return self.hops.measure()


def links_of(values: list[float], names: tuple[str, ...], prev: int | None, nxt: int | None) -> dict:
    """A rank's `links` in spans.jsonl and the ReportView: {"collective_s": {group: s},
    "pp_prev_s": s, "pp_next_s": s, "pp_prev": rank | None, "pp_next": rank | None}, per step,
    and "hop_s": {group: s}, its hop's round trip on the report step (only the rings it is in)."""
    n = len(names)
    hops = values[n + len(PEER_COLUMNS) :]
    return {
        "collective_s": {g: float(values[i]) for i, g in enumerate(names)},
        "pp_prev_s": float(values[n]),
        "pp_next_s": float(values[n + 1]),
        "pp_prev": prev,
        "pp_next": nxt,
        "hop_s": {g: float(v) for g, v in zip(HOP_NAMES, hops) if v > 0},
    }


def _span(ranks: list[int]) -> str:
    """ "4-7" for a run of ranks, "1, 5" otherwise."""
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ", ".join(map(str, ranks))


def _ms(seconds: float) -> str:
    """Milliseconds with one decimal below 10 (a clean hop's round trip is a fraction of one)."""
    return f"{seconds * 1e3:.1f}" if seconds < 0.01 else f"{seconds * 1e3:.0f}"


def _ranks_text(ranks: list[int]) -> str:
    """ "rank 3", "ranks 4-7"."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_span(ranks)}"


class LinkDetector:
    """Rank 0's slow-link, slow-rank and slow-node findings on report steps."""

    def __init__(self, cfg, grid, ratio: float = RATIO, floor_s: float | None = None):
        self.layout = grid.layout
        self.ratio = ratio
        device = getattr(getattr(grid.world, "device", None), "type", "cpu") or "cpu"
        self.floor_s = FLOOR_S.get(device, FLOOR_S["cpu"]) if floor_s is None else floor_s
        self.per_node = int(getattr(cfg.parallel, "devices_per_node", 0) or 0)
        self._since: dict[tuple[str, str], int] = {}
        """Identity -> the first report step of its streak beyond the loose margin."""

    def on_step(self, step: int, record: dict) -> list[Finding]:
        return []

    def on_report(self, view) -> list[Finding]:
        rows = {r["rank"]: r for r in view.ranks if "links" in r}
        if len(rows) < 2:
            return []
        per_node = int(view.extra.get("local_world_size") or self.per_node or len(view.ranks))
        slow = self._slow_ranks(rows, per_node, self.ratio)
        # Beyond half the margin (a slow rank's links are left out at the full margin's slow ranks).
        loose = 1 + (self.ratio - 1) * LOOSE
        near = self._find(view, rows, per_node, loose, self._slow_ranks(rows, per_node, loose), slow)
        before, self._since = self._since, {}
        for f in near:
            self._since[f.identity] = before.get(f.identity, view.step)
        found = self._find(view, rows, per_node, self.ratio, slow, slow)
        return [f for f in found if f.identity in before]

    def _find(self, view, rows: dict, per_node: int, ratio: float, slow: dict, exclude: dict) -> list[Finding]:
        found = self._nodes_and_ranks(view.step, slow, per_node, len(view.ranks))
        found += self._pairs(view.step, rows, set(exclude), per_node, ratio)
        hops = slow_hops(self.layout, rows, set(exclude), ratio, self.floor_s)
        found += self._groups(view.step, rows, set(exclude), ratio, hops)
        return found + [self._hop(view.step, hop, per_node) for hop in hops]

    def _seen(self, kind: str, key: str, step: int) -> int:
        return self._since.get((kind, key), step)

    # --- ranks and nodes --------------------------------------------------------------------

    def _slow_ranks(self, rows: dict, per_node: int, ratio: float) -> dict[int, tuple[float, float, int]]:
        """{rank: (own seconds, its stage peers' median, how many peers)} of each slow rank. The
        peers are the stage's ranks on other nodes where it has some (a slow node's ranks would
        otherwise make each other's median), else its other ranks."""
        own = {r: sum(row["time_s"].get(c, 0.0) for c in OWN_CATEGORIES) for r, row in rows.items()}
        stages: dict[int, list[int]] = {}
        for r, row in rows.items():
            stages.setdefault(row.get("pp", 0), []).append(r)
        out = {}
        for members in stages.values():
            nodes: dict[int, list[int]] = {}
            for i, r in enumerate(members):
                nodes.setdefault(r // per_node, []).append(i)
            drop = [nodes[r // per_node] if len(nodes) > 1 else [i] for i, r in enumerate(members)]
            medians = medians_without([own[r] for r in members], drop)
            for r, median, dropped in zip(members, medians, drop):
                if median > 0 and self._above(own[r], median, ratio):
                    out[r] = (own[r], median, len(members) - len(dropped))
        return out

    def _nodes_and_ranks(self, step: int, slow: dict, per_node: int, world: int) -> list[Finding]:
        found, in_node = [], set()
        nodes = sorted({r // per_node for r in slow})
        for node in nodes if world > per_node else ():
            ranks = list(range(node * per_node, min(world, (node + 1) * per_node)))
            if not all(r in slow for r in ranks):
                continue
            in_node.update(ranks)
            factor = statistics.median(slow[r][0] / slow[r][1] for r in ranks)
            key = f"node {node}"
            since = self._seen("slow_node", key, step)
            text = (
                f"slow node: node {node} ({_ranks_text(ranks)}): every rank computes {factor:.1f}x its stage "
                f"peers' median, since step {since}"
            )
            found.append(Finding("slow_node", key, text, step, since, tuple(ranks), node=node, value=factor))
        for r, (seconds, median, peers) in sorted(slow.items()):
            if r in in_node:
                continue
            key = f"rank {r}"
            since = self._seen("slow_rank", key, step)
            text = (
                f"slow rank: rank {r} (node {r // per_node}) computes {seconds / median:.1f}x its stage peers' median "
                f"({seconds * 1e3:.0f} ms vs {median * 1e3:.0f} ms per step, {peers} peers), since step {since}"
            )
            found.append(
                Finding(
                    "slow_rank", key, text, step, since, (r,), node=r // per_node,
                    stage=self.layout.coords(r)["pp"], value=seconds, baseline=median,
                )
            )  # fmt: skip
        return found

    # --- pipeline pairs ---------------------------------------------------------------------

    def _pairs(self, step: int, rows: dict, slow: set, per_node: int, ratio: float) -> list[Finding]:
        """Every pipeline pair (a, b) with a's next == b, by its two ends' waits on each other. A
        pair is slow when its lesser end's wait exceeds `ratio` x the other pairs' median, and each
        end exceeds the same end of the other pairs at its stage by half that margin: a link's delay
        adds the same time to both ends, where a late peer or a burst of load lifts one."""
        pairs = []
        for a, row in sorted(rows.items()):
            b = row["links"]["pp_next"]
            if b is None or b not in rows or rows[b]["links"]["pp_prev"] != a:
                continue
            wa, wb = row["links"]["pp_next_s"], rows[b]["links"]["pp_prev_s"]
            if wa > 0 and wb > 0:  # a wrap pair without virtual stages carries nothing
                pairs.append((a, b, wa, wb, row.get("pp", 0)))
        if len(pairs) < 2:
            return []
        scores = medians_of_others([min(p[2], p[3]) for p in pairs])
        ends = [medians_of_others([p[2] for p in pairs]), medians_of_others([p[3] for p in pairs])]
        for stage in {p[4] for p in pairs}:  # the same ends at the same stage, where there are peers
            at = [i for i, p in enumerate(pairs) if p[4] == stage]
            if len(at) > 1:
                for end in (0, 1):
                    for i, m in zip(at, medians_of_others([pairs[i][2 + end] for i in at])):
                        ends[end][i] = m
        half = 1 + (ratio - 1) / 2
        found = []
        for i, (a, b, wa, wb, _) in enumerate(pairs):
            if a in slow or b in slow or not self._above(min(wa, wb), scores[i], ratio):
                continue
            if not (self._above(wa, ends[0][i], half) and self._above(wb, ends[1][i], half)):
                continue
            wait, typical = (wa + wb) / 2, (ends[0][i] + ends[1][i]) / 2
            key = f"pp {a}->{b}"
            since = self._seen("slow_link", key, step)
            sa, sb = rows[a].get("pp", 0), rows[b].get("pp", 0)
            text = (
                f"slow link: pp {a} -> {b} (stage {sa} -> {sb}, node {a // per_node} -> node {b // per_node}) waits "
                f"{wait * 1e3:.0f} ms per step vs {typical * 1e3:.0f} ms median of {len(pairs) - 1} pairs, "
                f"since step {since}"
            )
            found.append(
                Finding(
                    "slow_link", key, text, step, since, (a, b), node=a // per_node, group="pp",
                    value=wait, baseline=typical, extra={"hop": [a, b], "nodes": [a // per_node, b // per_node]},
                )
            )  # fmt: skip
        return found

    def _above(self, value: float, median: float, ratio: float) -> bool:
        """`value` exceeds `ratio` x `median` and `median` by more than the noise floor."""
        return value > ratio * median and value - median > self.floor_s

    # --- collective groups ------------------------------------------------------------------

    def _hop(self, step: int, hop: tuple, per_node: int) -> Finding:
        """A slow hop of a ring group that no group finding holds (its dimension has one group,
        or the hop cost its group too little to stand out)."""
        name, a, b, seconds, median, peers = hop
        key = f"{name} {a}->{b}"
        since = self._seen("slow_link", key, step)
        text = (
            f"slow link: {name} hop {a} -> {b} (node {a // per_node} -> node {b // per_node}) takes "
            f"{_ms(seconds)} ms per round trip vs {_ms(median)} ms median of {peers} hops, since step {since}"
        )
        extra = {"hop": [a, b], "nodes": [a // per_node, b // per_node], "round_trip_s": seconds}
        return Finding("slow_link", key, text, step, since, (a, b), node=a // per_node, group=name,
                       value=seconds, baseline=median, extra=extra)  # fmt: skip

    @staticmethod
    def _peer_medians(lists: list, rows: dict, scores: list, middles: list) -> tuple[list, list]:
        """For each group, (its peers' median score, their median middle) and how many peers:
        the groups of the same pipeline stage where every stage has two or more (a stage's
        gradient reductions wait behind its own schedule: stage 0 finishes its backward last),
        else every other group of the dimension."""
        stages: dict[int, list[int]] = {}
        for i, g in enumerate(lists):
            stages.setdefault(rows[g[0]].get("pp", 0), []).append(i)
        sets = list(stages.values()) if all(len(v) > 1 for v in stages.values()) else [list(range(len(lists)))]
        others, peers = [None] * len(lists), [0] * len(lists)
        for at in sets:
            pairs = zip(medians_of_others([scores[i] for i in at]), medians_of_others([middles[i] for i in at]))
            for i, pair in zip(at, pairs):
                others[i], peers[i] = pair, len(at) - 1
        return others, peers

    def _groups(self, step: int, rows: dict, slow: set, ratio: float, hops: list) -> list[Finding]:
        """Slow groups; each takes the slow hops inside it out of `hops` and names them."""
        found = []
        for name, dims in COMPARED.items():
            lists = [g for g in self.layout.groups(GROUP_DIMS[dims]) if len(g) > 1]
            lists = [g for g in lists if all(r in rows for r in g)]
            if len(lists) < 2:
                continue
            times = [[rows[r]["links"]["collective_s"].get(name, 0.0) for r in g] for g in lists]
            # A slow member is the one that waits least; a link inside the group delays them all,
            # so its least- and its median-waiting member both stand out.
            scores = [min(t) for t in times]
            middles = [statistics.median(t) for t in times]
            others, peers = self._peer_medians(lists, rows, scores, middles)
            for i, (ranks, score, (median, middle)) in enumerate(zip(lists, scores, others)):
                if set(ranks) & slow or not self._above(score, median, ratio):
                    continue
                if not self._above(middles[i], middle, ratio):
                    continue
                key = f"{name} {ranks[0]}"
                since = self._seen("slow_link", key, step)
                inside = [h for h in hops if h[0] == name and h[1] in ranks]
                for h in inside:
                    hops.remove(h)
                if len(ranks) == 2:
                    hop = f": the hop is rank {ranks[0]} <-> {ranks[1]}"
                elif inside:  # the probe's round trips (observe/hops.py)
                    hop = ": the hop is " + ", ".join(
                        f"rank {h[1]} -> {h[2]} ({_ms(h[3])} ms per round trip vs {_ms(h[4])} ms)" for h in inside
                    )
                else:
                    hop = ""
                wait = middles[i]
                text = (
                    f"slow link: {name} group [{_span(ranks)}] waits {wait * 1e3:.0f} ms per step "
                    f"in its collectives vs {middle * 1e3:.0f} ms median of {peers[i]} groups{hop}, "
                    f"since step {since}"
                )
                extra = {"members_s": dict(zip(map(str, ranks), times[i]))}
                if len(ranks) == 2 or len(inside) == 1:
                    extra["hop"] = list(ranks) if len(ranks) == 2 else [inside[0][1], inside[0][2]]
                found.append(
                    Finding(
                        "slow_link", key, text, step, since, tuple(ranks), group=name,
                        value=wait, baseline=middle, extra=extra,
                    )
                )  # fmt: skip
        return found


def detector(cfg, grid):
    """The slow-link detector of this run (rank 0, report steps), or None with log.spans off."""
    ratio = getattr(cfg.log, "slow_ratio", RATIO)
    if not cfg.log.spans or not ratio:
        return None
    return LinkDetector(cfg, grid, ratio)
