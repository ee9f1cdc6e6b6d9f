"""Ranks onto a topology's nodes (planner/topology.py): every tp group inside one NVLink domain,
the outer dimensions packed into leaf switches so their rings cross the spine as little as the
layout allows.

Ranks follow the grid's order (distributed/grid.py, tp-cp-ep-dp-pp): a rank's node is the
placement's host number rank // gpus_per_node, which is the node rank torchrun gives that host.
So a placement is an ordered list of hosts, and it is chosen in three steps:

1. The **block**: the leading dimensions of the order that fit one NVLink domain (tp, then cp
   and ep while they still fit), grown to whole nodes by taking the next dimension's ranks
   (tp 2 on 8-GPU nodes puts 4 consecutive dp ranks on a node). tp that does not fit a domain
   is refused.
2. The **box**: the outer dimensions form a grid of blocks (ep, dp, pp sizes left after the
   block). Each leaf switch takes one box of that grid, sides dividing the grid's, as many
   blocks as the leaf holds; the shape is the one whose spine bytes (below) are least.
3. **Hosts**: boxes go to the leaves with the most healthy room first, a box's blocks to the
   leaf's domains in name order; what does not fill a whole box goes where room is left. The
   healthy nodes no block needs are spares; drained nodes take no rank.

Spine bytes per step count, for every group of every dimension, the bytes its members send over
links whose ends sit under different leaves: a ring (dp, edp, cp) sends `traffic[dim]` per
member to its successor, a chain (pp) per boundary, an all-to-all (ep) spreads it over the
other members. `box_spine_bytes` is the same count in closed form for a grid tiled by boxes,
one per leaf: the analytic minimum for the layout among leaf-aligned tilings, which `place`
reaches when the leaves hold whole boxes.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from threefold.distributed.grid import RankLayout
from threefold.errors import ConfigError
from threefold.planner.comm_cost import gradient_sync
from threefold.planner.topology import Node, Topology

# dim -> (grid tokens its groups vary in, traffic kind)
GROUPS = {"dp": (("ep", "dp"), "ring"), "edp": (("dp",), "ring"), "cp": (("cp",), "ring")}
GROUPS |= {"ep": (("ep",), "a2a"), "pp": (("pp",), "chain")}


@dataclass
class Placement:
    hosts: list[Node]
    """Node-rank order: host k runs ranks k * gpus_per_node ... (k + 1) * gpus_per_node - 1."""
    gpus_per_node: int
    block: dict[str, int] = field(default_factory=dict)
    """Ranks of each dimension inside one block (one NVLink domain, whole nodes); {} for the hostlist order."""
    box: dict[str, int] = field(default_factory=dict)
    """Blocks of each outer dimension per leaf ({} for the hostlist order)."""
    spares: list[Node] = field(default_factory=list)
    drained: list[Node] = field(default_factory=list)

    def node_of(self, rank: int) -> Node:
        return self.hosts[rank // self.gpus_per_node]

    def lines(self) -> list[str]:
        """One line per host: its node rank, name, domain, leaf and ranks; then spares and drained."""
        g = self.gpus_per_node
        out = [
            f"node_rank {k}: {n.name} (domain {n.domain}, leaf {n.leaf}) ranks {k * g}-{k * g + g - 1}"
            for k, n in enumerate(self.hosts)
        ]
        out += [f"spare: {n.name} (domain {n.domain}, leaf {n.leaf})" for n in self.spares]
        return out + [f"drained: {n.name}" for n in self.drained]


def _sizes(layout: RankLayout) -> dict[str, int]:
    return {"tp": layout.tp, "cp": layout.cp, "ep": layout.ep, "dp": layout.dp // layout.ep, "pp": layout.pp}


def block_and_grid(layout: RankLayout, topo: Topology) -> tuple[dict[str, int], list[tuple[str, int]]]:
    """(ranks per dimension inside a block, the outer grid's (dimension, blocks) in rank order)."""
    if layout.order != "tp-cp-ep-dp-pp":
        raise ConfigError("parallel.order", f"placement follows tp-cp-ep-dp-pp, not {layout.order!r}")
    g = topo.gpus_per_node
    domain = max(Counter(n.domain for n in topo.healthy).values()) * g  # the largest domain's GPUs
    if layout.tp > domain:
        raise ConfigError(
            "parallel.tp", f"tp={layout.tp} does not fit an NVLink domain of {domain} GPUs", f"tp <= {domain}"
        )
    sizes, block, inner = _sizes(layout), {}, 1
    for dim in ("tp", "cp", "ep"):  # contiguous in rank order: stop at the first that does not fit
        if inner * sizes[dim] > domain:
            break
        block[dim], inner = sizes[dim], inner * sizes[dim]
    outer = [(d, sizes[d] // block.get(d, 1)) for d in ("cp", "ep", "dp", "pp") if sizes[d] // block.get(d, 1) > 1]
    while inner % g:  # whole nodes: the next outer dimension's ranks fill the node
        f = g // math.gcd(inner, g)
        if inner > g or not outer or outer[0][1] % f:
            raise ConfigError("parallel", f"blocks of {inner} ranks (tp, cp, ep) do not fill whole nodes of {g} GPUs")
        dim, n = outer[0]
        block[dim], inner = block.get(dim, 1) * f, inner * f
        outer = ([(dim, n // f)] if n // f > 1 else []) + outer[1:]
    return block, outer


def _crossings(kind: str, n: int, side: int) -> float:
    """A group of `n` members along an axis tiled by `side` per leaf: its links that cross
    leaves, in units of its per-member traffic."""
    spans = n // side
    if kind == "ring":
        return spans if spans > 1 else 0
    if kind == "chain":
        return spans - 1
    return n * (n - side) / (n - 1)  # all-to-all: each member's share to the other leaves


def box_spine_bytes(layout: RankLayout, block: dict, grid: list[tuple[str, int]], box: dict, traffic: dict) -> float:
    """Spine bytes per step of the outer grid tiled by `box`, one box per leaf, in closed form.
    Holds where each dimension's groups run along one outer axis (the dense dp ring with ep
    inside the block or ep = 1); ValueError otherwise."""
    sizes, total = dict(grid), 0.0
    for dim, per_member in traffic.items():
        varying, kind = GROUPS[dim]
        outer = [t for t in varying if t in sizes]
        if not per_member or not outer:
            continue
        if len(outer) > 1:
            raise ValueError(f"{dim}'s groups run along {outer}: no closed form")
        axis = outer[0]
        size = math.prod(_sizes(layout)[t] for t in varying)
        total += layout.world_size // size * per_member * _crossings(kind, sizes[axis], box.get(axis, 1))
    return total


def boxes(grid: list[tuple[str, int]], room: int):
    """Every box shape (sides dividing the grid's) of at most `room` blocks."""
    sides = [[d for d in range(1, n + 1) if n % d == 0] for _, n in grid]
    for combo in itertools.product(*sides):
        if math.prod(combo) <= room:
            yield dict(zip((d for d, _ in grid), combo))


def _cells(grid: list[tuple[str, int]], box: dict[str, int]) -> list[list[int]]:
    """Block indices (first outer dimension fastest) of each box, boxes in grid order."""
    sizes = [n for _, n in grid]
    sides = [box[d] for d, _ in grid]
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    corners = itertools.product(*(range(n // s) for n, s in zip(reversed(sizes), reversed(sides))))
    out = []
    for corner in corners:
        corner = corner[::-1]
        offsets = itertools.product(*(range(s) for s in reversed(sides)))
        out.append(
            sorted(
                sum((c * s + o[i]) * st for i, (c, s, st) in enumerate(zip(corner, sides, strides)))
                for o in (x[::-1] for x in offsets)
            )
        )
    return out


def _units(topo: Topology, nodes_per_block: int) -> dict[str, list[list[Node]]]:
    """Per leaf, its blocks' worth of nodes: each domain's healthy nodes in name order, cut into
    runs of `nodes_per_block` (a remainder too short for a block is left over)."""
    leaves: dict[str, list[list[Node]]] = {}
    for domain in sorted({n.domain for n in topo.healthy}):
        members = sorted((n for n in topo.healthy if n.domain == domain), key=lambda n: n.name)
        runs = [members[i : i + nodes_per_block] for i in range(0, len(members) - nodes_per_block + 1, nodes_per_block)]
        leaves.setdefault(members[0].leaf, []).extend(runs)
    return leaves


def minimum_spine_bytes(layout: RankLayout, topo: Topology, traffic: dict[str, float]) -> float | None:
    """The analytic minimum: the least closed-form spine bytes over the boxes that fill the
    roomiest leaf exactly (or hold the whole grid). None where no box does (a leaf then holds
    several boxes, which the closed form does not count) or where a dimension's groups run
    along two outer axes."""
    block, grid = block_and_grid(layout, topo)
    room = max(len(u) for u in _units(topo, math.prod(block.values()) // topo.gpus_per_node).values())
    total = math.prod(n for _, n in grid)
    filling = [b for b in boxes(grid, room) if math.prod(b.values()) == min(room, total)]
    try:
        return min((box_spine_bytes(layout, block, grid, box, traffic) for box in filling), default=None)
    except ValueError:
        return None


def place(layout: RankLayout, topo: Topology, traffic: dict[str, float]) -> Placement:
    """Hosts for `layout` on `topo` (module docstring); `traffic` is each dimension's bytes per
    member per step (traffic_per_step), which decides the box: the least spine bytes (of two
    alike, the larger box)."""
    options = box_placements(layout, topo)
    return min(options, key=lambda p: (spine_bytes(layout, p, traffic), -math.prod(p.box.values())))


def box_placements(layout: RankLayout, topo: Topology) -> list[Placement]:
    """One placement of `layout` per box shape the roomiest leaf holds, spares and drained nodes
    listed (the box is place's choice, or the priced step's: planner/placement_plan.py)."""
    g = topo.gpus_per_node
    block, grid = block_and_grid(layout, topo)
    nodes_per_block = math.prod(block.values()) // g
    leaves = _units(topo, nodes_per_block)
    need = math.prod(n for _, n in grid)
    have = sum(len(u) for u in leaves.values())
    if have < need:
        raise ConfigError(
            "topology",
            f"{layout.world_size} ranks need {need} blocks of {nodes_per_block} node(s); the healthy nodes hold {have}",
        )
    order = sorted(leaves, key=lambda leaf: (-len(leaves[leaf]), leaf))
    drained = [n for n in topo.nodes if not n.healthy]
    out = []
    for box in boxes(grid, len(leaves[order[0]])):
        placement = _fill(grid, box, leaves, order, need, g, block)
        taken = set(map(id, placement.hosts + placement.spares))
        placement.spares += [n for n in topo.healthy if id(n) not in taken]
        placement.drained = drained
        out.append(placement)
    return out


def _fill(grid, box, leaves, order, need, g, block) -> Placement:
    """Boxes to the roomiest leaves that hold a whole one; the rest where room is left."""
    free = {leaf: list(leaves[leaf]) for leaf in order}
    assigned: dict[int, list[Node]] = {}
    pending: list[int] = []
    for cells in _cells(grid, box) if grid else [[0]]:
        leaf = next((lf for lf in order if len(free[lf]) >= len(cells)), None)
        if leaf is None:
            pending += cells
            continue
        for cell in cells:
            assigned[cell] = free[leaf].pop(0)
    for cell in pending:  # a fragmented allocation
        assigned[cell] = free[next(lf for lf in order if free[lf])].pop(0)
    hosts = [node for cell in range(need) for node in assigned[cell]]
    spares = [node for leaf in order for run in free[leaf] for node in run]
    return Placement(hosts, g, dict(block), dict(box), spares)


def hostlist_placement(layout: RankLayout, topo: Topology) -> Placement:
    """The plain order: healthy nodes as the topology lists them (a scheduler's host list)."""
    g = topo.gpus_per_node
    need = layout.world_size // g
    healthy = topo.healthy
    if layout.world_size % g or len(healthy) < need:
        raise ConfigError(
            "topology", f"{layout.world_size} ranks need {need} whole nodes of {g}; {len(healthy)} are healthy"
        )
    return Placement(healthy[:need], g, spares=healthy[need:], drained=[n for n in topo.nodes if not n.healthy])


def spine_bytes(layout: RankLayout, placement: Placement, traffic: dict[str, float]) -> float:
    """Bytes per step that cross leaf switches, counted link by link over every group."""
    total = 0.0
    for dim, bytes_per_member in traffic.items():
        varying, kind = GROUPS[dim]
        if not bytes_per_member or math.prod(_sizes(layout)[t] for t in varying) < 2:
            continue
        for group in layout.groups(varying):
            leaves = [placement.node_of(r).leaf for r in group]
            n = len(group)
            if kind == "a2a":
                total += sum(bytes_per_member * sum(x != a for x in leaves) / (n - 1) for a in leaves)
                continue
            total += bytes_per_member * sum(a != b for a, b in _links(leaves, kind))
    return total


def _links(members: list, kind: str):
    """A group's links in member order: a ring closes back to its first member, a chain does not."""
    return zip(members, members[1:] + members[:1]) if kind != "chain" else zip(members, members[1:])


def traffic_per_step(shape, layout, global_batch: int, act_bytes: int = 2, grad_bytes: int = 4) -> dict[str, float]:
    """Bytes per member per step of each dimension's groups, for the box choice and the spine
    count: the gradient ring (dense over dp x cp, experts over edp; a middle stage's share of the
    parameters, fp32 gradients unless `grad_bytes` says 2), each pipeline boundary's activations
    forward and gradients backward, each rank's all-to-all dispatch and combine (both passes), and
    the cp ring's K and V per layer (both passes)."""
    m = max(1, global_batch // (layout.mbs * layout.dp))
    dense, expert = shape.state_numel(shape.layers / layout.pp, shape.embed_params / layout.pp, layout.tp, layout.ep)

    def ring(numel: float, n: int) -> float:
        """What one member sends in the gradient sync of `numel` over `n` (comm_cost's own count)."""
        if n < 2:
            return 0.0
        return sum(b for b, _, _ in gradient_sync(numel, n, layout.zero, m, "inter", act_bytes, grad_bytes).values())

    tokens = layout.mbs * shape.seq_len // layout.cp
    activation = tokens * shape.hidden * act_bytes // (layout.tp if layout.sp else 1)
    head_dim = shape.hidden // shape.cfg.heads
    kv = 2 * tokens * head_dim * (getattr(shape.cfg, "kv_heads", 0) or shape.cfg.heads) // layout.tp * act_bytes
    moe_layers = shape.layers * shape.moe_fraction / layout.pp
    return {
        "dp": ring(dense, layout.dp * layout.cp),
        "edp": ring(expert, layout.dp // layout.ep) if layout.ep > 1 else 0.0,
        "pp": 2.0 * m * activation if layout.pp > 1 else 0.0,
        "ep": 4.0 * m * moe_layers * tokens * shape.top_k * shape.hidden * act_bytes if layout.ep > 1 else 0.0,
        "cp": 3.0 * m * shape.layers / layout.pp * (layout.cp - 1) * kv if layout.cp > 1 else 0.0,
    }


def rank_layout(layout) -> RankLayout:
    """The grid's rank arithmetic for a planner Layout."""
    return RankLayout(tp=layout.tp, cp=layout.cp, ep=layout.ep, dp=layout.dp, pp=layout.pp)


def placed_links(layout: RankLayout, placement: Placement, topo: Topology) -> tuple[dict[str, str], float]:
    """({dimension: planner link}, spine GB/s per device) of the placement: "intra" inside an
    NVLink domain, "inter" under one leaf, "spine" across leaves where the uplinks are the
    bottleneck. A dimension crossing leaves runs at its leaf's uplink share: the leaf's GPUs x
    spine_gbps over the most crossing links any leaf sends at once (each dimension's collectives
    at their own time). A packed ring crosses at a few nodes per leaf and keeps the leaf's speed
    ("inter"); a scattered one crosses everywhere and gets the oversubscribed share ("spine", the
    least such share being the spine bandwidth returned)."""
    links, spine = {}, topo.bandwidth_gbps["leaf"]
    per_leaf_gpus: dict[str, int] = {}
    for node in placement.hosts:
        per_leaf_gpus[node.leaf] = per_leaf_gpus.get(node.leaf, 0) + placement.gpus_per_node
    for dim, (varying, kind) in {"tp": (("tp",), "ring"), **GROUPS}.items():
        if math.prod(_sizes(layout)[t] for t in varying) < 2:
            continue
        worst, crossing = 0, {}
        for group in layout.groups(varying):
            nodes = [placement.node_of(r) for r in group]
            for a, b in _links(nodes, kind):
                if a.domain == b.domain:
                    continue
                worst = max(worst, 1 if a.leaf == b.leaf else 2)
                if a.leaf != b.leaf:
                    crossing[a.leaf] = crossing.get(a.leaf, 0) + 1
        share = min((per_leaf_gpus[leaf] * topo.bandwidth_gbps["spine"] / n for leaf, n in crossing.items()), default=0)
        contended = worst == 2 and share < topo.bandwidth_gbps["leaf"]
        links[dim] = "spine" if contended else ("intra", "inter", "inter")[worst]
        if contended:
            spine = min(spine, share)
    links["edp"] = links.get("edp", links.get("dp", "intra"))
    return {d: links[d] for d in ("tp", "cp", "ep", "dp", "pp") if d in links}, spine
