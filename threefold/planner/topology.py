"""The cluster as its links group it: NVLink domains, leaf switches and the spine above them.

A topology is a list of nodes, each with its NVLink domain (the node itself on NVL8 machines; a
rack's trays on GB200 NVL72) and its leaf switch, the GPUs per node, and the bandwidth per GPU
at each level: inside a domain (`nvlink_gbps`), between nodes under one leaf (`leaf_gbps`), and
across leaves through the spine (`spine_gbps`, the leaf's uplinks: half of `leaf_gbps` on a 2:1
oversubscribed fat tree). Nodes an operator drained, or the pre-flight probe named, are marked
unhealthy and take no rank.

It is read from a TOML file (`threefold plan --topology FILE`):

    [topology]
    gpus_per_node = 8
    nvlink_gbps = 370
    leaf_gbps = 48
    spine_gbps = 24
    drain = ["gpu017"]                 # optional
    slurm = "scontrol_topology.txt"    # optional: the nodes from `scontrol show topology`

    [[node]]                           # or nodes listed one by one
    name = "gpu001"
    domain = "gpu001"                  # default: the node's own name
    leaf = "leaf0"

`scontrol show topology` prints one line per switch (topology/tree: `SwitchName=s0 Level=0
LinkSpeed=1 Nodes=gpu[001-032]`; a level-0 switch is a leaf) or per block (topology/block:
`BlockName=b1 BlockIndex=0 Nodes=gpu[001-018] BlockSize=18`; a block is an NVLink domain and
its own leaf). `fat_tree` and `nvl72` build the topologies of the tests and of what-if plans.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from threefold.config import read_toml_file
from threefold.errors import ConfigError

LEVELS = ("nvlink", "leaf", "spine")
"""Link levels, fastest first: inside a domain, under one leaf switch, across leaves."""


@dataclass(frozen=True)
class Node:
    name: str
    domain: str
    leaf: str
    healthy: bool = True


@dataclass
class Topology:
    nodes: list[Node]
    gpus_per_node: int
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    """GB/s per GPU at each of LEVELS."""

    @property
    def healthy(self) -> list[Node]:
        return [n for n in self.nodes if n.healthy]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list: `gpu[001-003,007],login1` -> gpu001 gpu002 gpu003 gpu007 login1."""
    out: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[\]]*)\[([^\]]*)\]|([^,\[\]]+)", text):
        if plain:
            out.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ConfigError(
                    "topology.slurm", f"host range {prefix}[{ranges}] is not numeric", "e.g. gpu[001-032]"
                )
            out += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def from_scontrol(text: str) -> list[Node]:
    """Nodes of `scontrol show topology` output (topology/tree: level-0 switches are leaves;
    topology/block: each block is an NVLink domain and its leaf)."""
    nodes: dict[str, Node] = {}
    for line in text.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S+)", line))
        if "Nodes" not in fields:
            continue
        if "BlockName" in fields:
            block = fields["BlockName"]
            for name in expand_hostlist(fields["Nodes"]):
                nodes[name] = Node(name, block, block)
        elif fields.get("Level") == "0" and "SwitchName" in fields:
            for name in expand_hostlist(fields["Nodes"]):
                nodes[name] = Node(name, name, fields["SwitchName"])
    if not nodes:
        raise ConfigError(
            "topology.slurm", "no level-0 switch or block with Nodes= in the output", "scontrol show topology"
        )
    return list(nodes.values())


def read_topology(path: str) -> Topology:
    data = read_toml_file(path, "topology")
    top = data.get("topology")
    if not isinstance(top, dict):
        raise ConfigError("topology", f"{path} has no [topology] table", "gpus_per_node, *_gbps and [[node]] entries")
    gpus = top.get("gpus_per_node")
    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError("topology.gpus_per_node", f"{path}: {gpus!r} is not a positive integer", "e.g. 8")
    bandwidth = {}
    for level in LEVELS:
        value = top.get(f"{level}_gbps")
        if not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"topology.{level}_gbps", f"{path}: {value!r} is not a bandwidth > 0", "GB/s per GPU")
        bandwidth[level] = float(value)
    nodes = []
    if top.get("slurm"):
        from pathlib import Path

        slurm = Path(path).parent / str(top["slurm"])
        try:
            nodes += from_scontrol(slurm.read_text(encoding="utf-8"))
        except OSError as err:
            raise ConfigError("topology.slurm", f"cannot read {slurm}: {err.strerror}") from None
    for entry in data.get("node", []):
        if not isinstance(entry, dict) or not entry.get("name") or not entry.get("leaf"):
            raise ConfigError("node", f"{path}: {entry!r} needs a name and a leaf", 'name = "gpu001", leaf = "leaf0"')
        nodes.append(Node(str(entry["name"]), str(entry.get("domain", entry["name"])), str(entry["leaf"])))
    if not nodes:
        raise ConfigError("topology", f"{path} lists no nodes", "[[node]] entries or topology.slurm")
    drained = set(top.get("drain", []))
    unknown = drained - {n.name for n in nodes}
    if unknown:
        raise ConfigError("topology.drain", f"{path}: {sorted(unknown)[0]!r} is not a node of the topology")
    nodes = [Node(n.name, n.domain, n.leaf, n.name not in drained) for n in nodes]
    return Topology(nodes, gpus, bandwidth)


def fat_tree(nodes: int, per_leaf: int, gpus: int = 8, oversubscription: float = 2.0, leaf_gbps: float = 48.0):
    """NVL8 nodes (each its own NVLink domain) under leaves of `per_leaf` nodes, the spine at
    1 / oversubscription of the leaf's bandwidth."""
    names = [f"gpu{i:05d}" for i in range(nodes)]
    members = [Node(name, name, f"leaf{i // per_leaf:03d}") for i, name in enumerate(names)]
    return Topology(members, gpus, {"nvlink": 370.0, "leaf": leaf_gbps, "spine": leaf_gbps / oversubscription})


def nvl72(racks: int, racks_per_leaf: int = 1, trays: int = 18, gpus: int = 4):
    """GB200 NVL72: `trays` nodes of `gpus` GPUs per rack share one NVLink domain; racks under
    leaves of `racks_per_leaf`, the spine at half the leaf's bandwidth."""
    members = [
        Node(f"r{r:03d}t{t:02d}", f"rack{r:03d}", f"leaf{r // racks_per_leaf:03d}")
        for r in range(racks)
        for t in range(trays)
    ]
    return Topology(members, gpus, {"nvlink": 900.0, "leaf": 100.0, "spine": 50.0})
