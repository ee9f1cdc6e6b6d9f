"""Placement onto a topology (planner/topology.py, planner/placement.py): tp groups inside
NVLink domains, spine bytes at the analytic minimum and below the plain host order, the planner
pricing the links a placement gives, drained nodes and spares, and the topology's inputs."""

from __future__ import annotations

import dataclasses
import json

import pytest
from planner_helpers import model

from threefold.errors import ConfigError
from threefold.planner import Layout, build_cluster, model_shape, predict
from threefold.planner.placement import (
    block_and_grid,
    box_spine_bytes,
    hostlist_placement,
    minimum_spine_bytes,
    place,
    placed_links,
    rank_layout,
    spine_bytes,
    traffic_per_step,
)
from threefold.planner.topology import Node, Topology, expand_hostlist, fat_tree, from_scontrol, nvl72, read_topology

GPT = model_shape(model([("model.preset", "gpt-175b")]))
MOE = model_shape(model([("model.preset", "olmoe-1b-7b"), ("model.num_experts", "64")]))
BIG = Layout(tp=8, pp=16, dp=128, mbs=1, sp=True)  # 16,384 GPUs
RACKS = Layout(tp=4, ep=16, dp=64, pp=4, mbs=1)  # 1,024 GPUs on NVL72: tp 4 x ep 16 per rack


def striped(topo: Topology, leaves: int) -> Topology:
    """The same nodes with leaves striped over the host names: a host list that follows racks
    while the leaves are cabled across them."""
    nodes = [Node(n.name, n.domain, f"leaf{i % leaves:03d}") for i, n in enumerate(topo.nodes)]
    return Topology(nodes, topo.gpus_per_node, topo.bandwidth_gbps)


def groups_within(layout, placement, varying, attr: str) -> bool:
    return all(len({getattr(placement.node_of(r), attr) for r in g}) == 1 for g in rank_layout(layout).groups(varying))


def test_every_tp_group_stays_inside_an_nvlink_domain():
    nvl8 = striped(fat_tree(2048, 32), 64)
    big = place(rank_layout(BIG), nvl8, traffic_per_step(GPT, BIG, 1536))
    assert len(big.hosts) == 2048 and groups_within(BIG, big, ("tp",), "domain")
    racks = nvl72(18, racks_per_leaf=2)
    on_racks = place(rank_layout(RACKS), racks, traffic_per_step(MOE, RACKS, 1024))
    assert groups_within(RACKS, on_racks, ("tp",), "domain") and groups_within(RACKS, on_racks, ("tp", "ep"), "domain")
    assert on_racks.block == {"tp": 4, "cp": 1, "ep": 16} and len(on_racks.hosts) == 16 * 16
    assert len(on_racks.spares) == 18 * 18 - 16 * 16  # two trays of every used rack, and two whole racks
    # The host list as trays are named: a 64-GPU block (16 trays) from tray 16 of one rack on.
    plain = hostlist_placement(rank_layout(RACKS), racks)
    assert groups_within(RACKS, plain, ("tp",), "domain") and not groups_within(RACKS, plain, ("tp", "ep"), "domain")
    with pytest.raises(ConfigError, match="tp=16 does not fit an NVLink domain of 8 GPUs"):
        place(rank_layout(Layout(tp=16, dp=8)), nvl8, {})


def test_spine_bytes_are_the_analytic_minimum_and_below_the_host_order():
    cases = [
        (BIG, striped(fat_tree(2048, 32), 64), traffic_per_step(GPT, BIG, 1536)),
        (RACKS, nvl72(18, racks_per_leaf=2), traffic_per_step(MOE, RACKS, 1024)),
    ]
    for layout, topo, traffic in cases:
        ranks = rank_layout(layout)
        placed = place(ranks, topo, traffic)
        block, grid = block_and_grid(ranks, topo)
        minimum = box_spine_bytes(ranks, block, grid, placed.box, traffic)
        counted, plain = (
            spine_bytes(ranks, placed, traffic),
            spine_bytes(ranks, hostlist_placement(ranks, topo), traffic),
        )
        figures = f"spine {counted / 1e9:.1f} GB, minimum {minimum / 1e9:.1f}, host order {plain / 1e9:.1f}"
        print(f"{layout.spec()}: box {placed.box}, {figures}")
        assert counted == pytest.approx(minimum) and counted < plain
        assert minimum == pytest.approx(minimum_spine_bytes(ranks, topo, traffic))  # no box does better


def test_the_planner_prices_the_links_a_placement_gives():
    cluster = build_cluster({"device": "h100", "nodes": 2048, "inter_bw_gbps": 48})
    ranks, traffic = rank_layout(BIG), traffic_per_step(GPT, BIG, 1536)

    def step(topo, placement) -> float:
        links, spine = placed_links(ranks, placement, topo)
        priced = dataclasses.replace(cluster, links=links, spine_bw_gbps=spine)
        return predict(GPT, priced, BIG, 1536).step_time_s

    # Leaves striped over the host list: its dp rings cross the spine at every hop, at the
    # oversubscribed share; the placement's cross it at 4 hops each, at the leaf's speed.
    scattered = striped(fat_tree(2048, 32), 64)
    plain = hostlist_placement(ranks, scattered)
    assert placed_links(ranks, plain, scattered) == ({"tp": "intra", "dp": "spine", "pp": "inter"}, 24.0)
    assert step(scattered, place(ranks, scattered, traffic)) < 0.95 * step(scattered, plain)
    # Host names in leaf order: the host list is already the placement, and so is the price.
    ordered = fat_tree(2048, 32)
    assert step(ordered, place(ranks, ordered, traffic)) == step(ordered, hostlist_placement(ranks, ordered))


def test_drained_nodes_take_no_rank_and_the_rest_are_spares():
    # 3 leaves of 4, 4 and 2 nodes; one node of the first drained; tp 8 x dp 4 needs 4 nodes.
    nodes = [Node(f"n{i:02d}", f"n{i:02d}", f"leaf{min(i // 4, 2)}", healthy=i != 1) for i in range(10)]
    topo = Topology(nodes, 8, {"nvlink": 370.0, "leaf": 48.0, "spine": 24.0})
    layout = Layout(tp=8, dp=4, mbs=1)
    placed = place(rank_layout(layout), topo, traffic_per_step(GPT, layout, 64))
    # The one whole leaf of 4 healthy nodes holds the ring: nothing crosses the spine.
    assert [n.name for n in placed.hosts] == ["n04", "n05", "n06", "n07"]
    assert spine_bytes(rank_layout(layout), placed, traffic_per_step(GPT, layout, 64)) == 0
    assert [n.name for n in placed.drained] == ["n01"] and len(placed.spares) == 5
    assert placed.lines()[0] == "node_rank 0: n04 (domain n04, leaf leaf1) ranks 0-7"
    with pytest.raises(ConfigError, match="need 10 blocks"):
        place(rank_layout(Layout(tp=8, dp=10, mbs=1)), topo, {})


def test_a_topology_from_its_file_and_from_slurm(tmp_path):
    assert expand_hostlist("gpu[001-003,007],login1") == ["gpu001", "gpu002", "gpu003", "gpu007", "login1"]
    tree = "SwitchName=s0 Level=0 LinkSpeed=1 Nodes=gpu[01-04]\nSwitchName=s1 Level=0 LinkSpeed=1 Nodes=gpu[05-08]\n"
    tree += "SwitchName=s2 Level=1 LinkSpeed=1 Switches=s[0-1] Nodes=gpu[01-08]\n"
    assert [(n.name, n.leaf) for n in from_scontrol(tree)][3:5] == [("gpu04", "s0"), ("gpu05", "s1")]
    block = "BlockName=b1 BlockIndex=0 Nodes=tray[01-18] BlockSize=18\n"
    assert {n.domain for n in from_scontrol(block)} == {"b1"}
    (tmp_path / "scontrol.txt").write_text(tree)
    path = tmp_path / "topo.toml"
    head = '[topology]\ngpus_per_node = 8\nnvlink_gbps = 370\nleaf_gbps = 48\nspine_gbps = 24\nslurm = "scontrol.txt"\n'
    path.write_text(head + 'drain = ["gpu02"]\n[[node]]\nname = "gpu09"\nleaf = "s1"\n')
    topo = read_topology(str(path))
    assert len(topo.nodes) == 9 and [n.name for n in topo.nodes if not n.healthy] == ["gpu02"]
    assert topo.bandwidth_gbps == {"nvlink": 370.0, "leaf": 48.0, "spine": 24.0}
    path.write_text(head.replace("leaf_gbps = 48", "leaf_gbps = 0"))
    with pytest.raises(ConfigError, match="topology.leaf_gbps"):
        read_topology(str(path))
    path.write_text(head + 'drain = ["gpu99"]\n')
    with pytest.raises(ConfigError, match="'gpu99' is not a node"):
        read_topology(str(path))


def test_plan_places_the_layout_and_writes_its_hosts(tmp_path, capsys):
    from planner_helpers import plan_cli

    # 40 nodes striped over 5 leaves of 8, one drained: tp 8 x pp 2 x dp 16 needs 32.
    lines = ["[topology]", "gpus_per_node = 8", "nvlink_gbps = 370", "leaf_gbps = 48", "spine_gbps = 24"]
    lines += ['drain = ["gpu005"]'] + [f'[[node]]\nname = "gpu{i:03d}"\nleaf = "leaf{i % 5}"' for i in range(40)]
    (tmp_path / "topo.toml").write_text("\n".join(lines) + "\n")
    args = ["--model.preset", "llama-7b", "--cluster.device", "h100", "--train.global_batch", "256"]
    args += ["--layout", "tp=8,pp=2,dp=16,mbs=1", "--topology", str(tmp_path / "topo.toml")]
    code, out, err = plan_cli(capsys, *args, "--json", "--placement-out", str(tmp_path / "hosts.json"))
    assert code == 0, err
    doc = json.loads(out)["placement"]
    assert doc == json.loads((tmp_path / "hosts.json").read_text())
    assert len(doc["hosts"]) == 32 and "gpu005" not in doc["hosts"] and doc["drained"] == ["gpu005"]
    assert doc["spine_bytes_per_step"] == pytest.approx(doc["minimum_spine_bytes_per_step"])
    assert doc["spine_bytes_per_step"] < doc["host_order"]["spine_bytes_per_step"]
    assert doc["step_time_s"] < doc["host_order"]["step_time_s"]
    code, out, _ = plan_cli(capsys, *args)
    assert code == 0 and "placement: tp 8 per NVLink domain; dp 4 x pp 2 blocks per leaf; 32 hosts, 7 spares" in out
    code, _, err = plan_cli(capsys, *args[:-2], "--placement-out", str(tmp_path / "x.json"))
    assert code != 0 and "--placement-out" in err and "--topology" in err
    # A search on 32 nodes over 4 leaves: each of the 5 fastest layouts priced with its own
    # placement, and the fastest placed is the one placed.
    lines = lines[:5] + [f'[[node]]\nname = "gpu{i:03d}"\nleaf = "leaf{i % 4}"' for i in range(32)]
    (tmp_path / "topo32.toml").write_text("\n".join(lines) + "\n")
    search = args[:6] + ["--topology", str(tmp_path / "topo32.toml"), "--top", "5", "--json"]
    code, out, err = plan_cli(capsys, *search)
    assert code == 0, err
    doc = json.loads(out)["placement"]
    rows = doc["reranked"]
    assert len(rows) == 5 and doc["layout"] == min(rows, key=lambda r: r["placed_step_time_s"])["layout"]
    assert doc["step_time_s"] == min(r["placed_step_time_s"] for r in rows)


def test_the_launch_scripts_start_the_hosts_in_placement_order(tmp_path, capsys):
    import shlex

    from planner_helpers import plan_cli

    lines = ["[topology]", "gpus_per_node = 8", "nvlink_gbps = 370", "leaf_gbps = 48", "spine_gbps = 24"]
    lines += [f'[[node]]\nname = "gpu{i:03d}"\nleaf = "leaf{i % 3}"' for i in range(12)]
    (tmp_path / "topo.toml").write_text("\n".join(lines) + "\n")
    args = ["--model.preset", "llama-7b", "--cluster.device", "h100", "--train.global_batch", "64"]
    args += ["--layout", "tp=8,pp=2,dp=4,mbs=1", "--topology", str(tmp_path / "topo.toml")]
    args += ["--placement-out", str(tmp_path / "hosts.json"), "--emit-config", str(tmp_path / "run.toml")]
    code, _, err = plan_cli(capsys, *args, "--launch-out", str(tmp_path / "launch"), "--launch-image", "reg/tf:1")
    assert code == 0, err
    hosts = json.loads((tmp_path / "hosts.json").read_text())["hosts"]
    assert len(hosts) == 8 and hosts != sorted(hosts)  # the placement's order, not the names'
    assert (tmp_path / "launch" / "hostfile").read_text().split() == hosts
    # Slurm: task k on line k of SLURM_HOSTFILE, torchrun's node rank its task id, node 0 the master.
    script = (tmp_path / "launch" / "launch.sbatch").read_text().splitlines()
    assert f"#SBATCH --nodelist={','.join(hosts)}" in script and "#SBATCH --nodes=8" in script
    assert f"export SLURM_HOSTFILE={tmp_path / 'launch' / 'hostfile'}" in script
    srun = shlex.split(next(line for line in script if line.startswith("srun ")))
    assert srun[:4] == ["srun", "--ntasks=8", "--distribution=arbitrary", "bash"] and srun[4] == "-c"
    agent = shlex.split(srun[5])
    assert "--node-rank=$SLURM_PROCID" in agent and f"--master-addr={hosts[0]}" in agent
    assert agent[-2:] == ["--config", str(tmp_path / "run.toml")] and "--nnodes=8" in agent
    # Kubernetes: job node-k pinned to hosts[k] with node rank k.
    manifest = json.loads((tmp_path / "launch" / "jobset.json").read_text())
    jobs = manifest["spec"]["replicatedJobs"]
    pods = [job["template"]["spec"]["template"]["spec"] for job in jobs]
    assert [pod["nodeSelector"]["kubernetes.io/hostname"] for pod in pods] == hosts
    ranks = [next(a for a in pod["containers"][0]["command"] if a.startswith("--node-rank=")) for pod in pods]
    assert ranks == [f"--node-rank={k}" for k in range(8)] and pods[0]["containers"][0]["image"] == "reg/tf:1"
    code, _, err = plan_cli(capsys, *args[:-2], "--launch-out", str(tmp_path / "x"))
    assert code != 0 and "--emit-config" in err


def test_the_plan_keeps_the_placement_whose_step_prices_lowest():
    """The placement the planner keeps is never slower than the host-list order, and equal where
    its links are the host order's: of the boxes, the one the priced step favours (the fewest
    spine bytes can be the slower step: llama-7b tp 2 x pp 4 x dp 32 on 32 nodes striped over 4
    leaves packs dp into leaves and sends every pipeline boundary over contended uplinks)."""
    from threefold.planner.placement_plan import placed, priced

    shape = model_shape(model([("model.preset", "llama-7b")]))
    cluster = build_cluster({"device": "h100", "nodes": 32, "inter_bw_gbps": 48, "intra_bw_gbps": 370})
    striped32, ordered32 = striped(fat_tree(32, 8), 4), fat_tree(32, 8)
    layouts = [Layout(tp=2, pp=4, dp=32, mbs=1, sp=True), Layout(tp=8, pp=4, dp=8, mbs=1, sp=True)]
    layouts += [Layout(tp=4, pp=2, dp=32, mbs=1, sp=True), Layout(tp=1, pp=8, dp=32, mbs=1)]
    layouts += [Layout(tp=8, pp=1, dp=32, mbs=1, sp=True, zero=1)]
    lower = equal = 0
    for topo in (striped32, ordered32):
        for layout in layouts:
            placement, ranks, traffic, pred = placed(shape, cluster, layout, 256, "bf16", topo)
            plain = hostlist_placement(ranks, topo)
            host = priced(shape, cluster, layout, 256, "bf16", topo, plain).step_time_s
            assert pred.step_time_s <= host, (layout.spec(), topo.nodes[1].leaf, pred.step_time_s, host)
            if placed_links(ranks, placement, topo) == placed_links(ranks, plain, topo):
                assert pred.step_time_s == host
                equal += 1
            else:
                assert pred.step_time_s < host, (layout.spec(), topo.nodes[1].leaf, pred.step_time_s, host)
                lower += 1
    assert (lower, equal) == (5, 5)
    # The counter-example: the least-bytes box prices slower than a box with pp inside leaves.
    layout = layouts[0]
    ranks, traffic = rank_layout(layout), traffic_per_step(shape, layout, 256)
    least = place(ranks, striped32, traffic)
    kept = placed(shape, cluster, layout, 256, "bf16", striped32)[0]
    assert spine_bytes(ranks, least, traffic) < spine_bytes(ranks, kept, traffic)
    slower = priced(shape, cluster, layout, 256, "bf16", striped32, least).step_time_s
    assert priced(shape, cluster, layout, 256, "bf16", striped32, kept).step_time_s < slower
