"""`threefold plan --topology FILE`: the cluster's links taken from the topology, and the chosen
layout placed on it (planner/placement.py), priced with the placement's links next to the plain
host order, and written out as hosts in node-rank order."""

from __future__ import annotations

import dataclasses
import json
import math

from threefold.atomic import atomic_write
from threefold.errors import ConfigError
from threefold.planner.placement import (
    block_and_grid,
    box_placements,
    hostlist_placement,
    minimum_spine_bytes,
    placed_links,
    rank_layout,
    spine_bytes,
    traffic_per_step,
)
from threefold.planner.predict import predict
from threefold.planner.topology import Topology


def cluster_pairs(topo: Topology, named: set[str]) -> list[tuple[str, object]]:
    """The [cluster] keys the topology sets, unless --cluster.KEY names them: GPUs per node,
    healthy nodes, NVLink and leaf bandwidth per GPU."""
    values = {
        "devices_per_node": topo.gpus_per_node,
        "nodes": len(topo.healthy),
        "intra_bw_gbps": topo.bandwidth_gbps["nvlink"],
        "inter_bw_gbps": topo.bandwidth_gbps["leaf"],
    }
    return [(key, value) for key, value in values.items() if key not in named]


def placement_check(topo: Topology):
    """search()'s `admit`: a layout the topology cannot place (its blocks of tp, cp and ep do not
    fill whole nodes, or tp outgrows an NVLink domain) is rejected for "placement"."""

    def admit(layout) -> tuple[str, str] | None:
        try:
            block_and_grid(rank_layout(layout), topo)
        except ConfigError as err:
            return "placement", f"{err}."
        return None

    return admit


def placed(shape, cluster, layout, global_batch: int, dtype: str, topo: Topology):
    """(the layout's placement, its ranks, traffic, and the prediction with the placement's links).
    Of the boxes (planner/placement.py), the one whose links price the step lowest; of boxes
    priced alike, the least spine bytes (place's own choice). The fewest bytes can still be the
    slower step: a box packing dp rings into leaves may send every pipeline boundary over a
    contended uplink. The host-list order is kept only where it prices lower than every box."""
    ranks = rank_layout(layout)
    traffic = traffic_per_step(shape, layout, global_batch, 2 if dtype == "bf16" else 4)
    options = []
    for k, placement in enumerate(box_placements(ranks, topo)):
        pred = priced(shape, cluster, layout, global_batch, dtype, topo, placement)
        bytes_ = spine_bytes(ranks, placement, traffic)
        options.append(((pred.step_time_s, bytes_, -math.prod(placement.box.values()), k), placement, pred))
    best = min(options, key=lambda o: o[0])
    try:
        plain = hostlist_placement(ranks, topo)
    except ConfigError:
        plain = None
    if plain is not None:
        pred = priced(shape, cluster, layout, global_batch, dtype, topo, plain)
        if pred.step_time_s < best[0][0]:
            best = (None, plain, pred)
    return best[1], ranks, traffic, best[2]


def priced(shape, cluster, layout, global_batch: int, dtype: str, topo: Topology, placement):
    """The prediction of `layout` with the links `placement` gives it."""
    links, spine = placed_links(rank_layout(layout), placement, topo)
    return predict(shape, dataclasses.replace(cluster, links=links, spine_bw_gbps=spine), layout, global_batch, dtype)


def rerank(candidates, shape, cluster, global_batch: int, dtype: str, topo: Topology):
    """(the candidate fastest once placed, [{layout, step_time_s, placed_step_time_s}] for each):
    the search's ranking priced with each layout's own placement on the topology."""
    rows, best = [], None
    for pred in candidates:
        row = {"layout": pred.layout.spec(), "step_time_s": pred.step_time_s}
        try:
            step = placed(shape, cluster, pred.layout, global_batch, dtype, topo)[3].step_time_s
        except ConfigError as err:
            rows.append(row | {"unplaced": str(err)})
            continue
        rows.append(row | {"placed_step_time_s": step})
        if best is None or step < best[0]:
            best = (step, pred)
    return (best[1] if best else candidates[0]), rows


def placement_doc(shape, cluster, layout, global_batch: int, dtype: str, topo: Topology) -> dict:
    """The layout placed and priced: hosts, spares, spine bytes (placed, minimum, host order) and
    the predicted step with each placement's links."""
    placement, ranks, traffic, pred = placed(shape, cluster, layout, global_batch, dtype, topo)
    doc = {
        "block": placement.block,
        "box": placement.box,
        "hosts": [n.name for n in placement.hosts],
        "spares": [n.name for n in placement.spares],
        "drained": [n.name for n in placement.drained],
        "links": placed_links(ranks, placement, topo)[0],
        "spine_bytes_per_step": spine_bytes(ranks, placement, traffic),
        "minimum_spine_bytes_per_step": minimum_spine_bytes(ranks, topo, traffic),
        "step_time_s": pred.step_time_s,
    }
    try:
        plain = hostlist_placement(ranks, topo)
    except ConfigError:
        return doc | {"host_order": None}
    step = priced(shape, cluster, layout, global_batch, dtype, topo, plain).step_time_s
    return doc | {"host_order": {"spine_bytes_per_step": spine_bytes(ranks, plain, traffic), "step_time_s": step}}


def placement_lines(doc: dict) -> list[str]:
    block = " x ".join(f"{d} {n}" for d, n in doc["block"].items() if n > 1) or "one rank"
    box = " x ".join(f"{d} {n}" for d, n in doc["box"].items()) or "the whole grid"
    least = doc["minimum_spine_bytes_per_step"]
    minimum = "no closed-form minimum for this grid" if least is None else f"minimum {least / 1e9:,.1f} GB"
    lines = [
        f"placement: {block} per NVLink domain; {box} blocks per leaf; {len(doc['hosts'])} hosts, "
        f"{len(doc['spares'])} spares, {len(doc['drained'])} drained",
        f"  spine bytes per step: {doc['spine_bytes_per_step'] / 1e9:,.1f} GB placed ({minimum})",
        "  links: " + ", ".join(f"{d} {link}" for d, link in doc["links"].items()),
    ]
    if doc.get("reranked"):
        first = doc["reranked"][0]
        placed_first = first.get("placed_step_time_s")
        first_text = f"{placed_first:.4g} s placed" if placed_first else f"not placed: {first.get('unplaced')}"
        lines.append(
            f"  re-ranked the search's {len(doc['reranked'])} fastest by their placements' links: {doc['layout']} "
            f"is fastest placed; the search's first, {first['layout']}, {first_text}"
        )
    plain = doc["host_order"]
    step = f"  step with the placement's links {doc['step_time_s']:.4g} s"
    if plain:
        lines[1] += f", {plain['spine_bytes_per_step'] / 1e9:,.1f} GB in host-list order"
        step += f"; in host-list order {plain['step_time_s']:.4g} s"
    return lines + [step]


def write_placement(path: str, doc: dict) -> None:
    """JSON: hosts in node-rank order (torchrun --node-rank k on hosts[k]), spares, drained."""
    atomic_write(path, json.dumps(doc, indent=1))
