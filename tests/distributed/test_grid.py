import pytest

from threefold.distributed.grid import RankLayout
from threefold.errors import ConfigError

from harness import run_ranks


def test_tp_is_innermost_by_default():
    lay = RankLayout(tp=2, dp=2, pp=2)
    groups = lay.group_lists()
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_coords_round_trip_for_every_rank():
    lay = RankLayout(tp=2, dp=4, pp=3, ep=2, order="tp-cp-ep-dp-pp")
    seen = set()
    for rank in range(lay.world_size):
        c = lay.coords(rank)
        assert lay.rank_of(tp=c["tp"], dp=c["dp"], pp=c["pp"]) == rank
        seen.add((c["tp"], c["dp"], c["pp"]))
    assert len(seen) == lay.world_size


def test_every_group_kind_partitions_the_world():
    lay = RankLayout(tp=2, dp=4, pp=2, ep=2)
    for name, lists in lay.group_lists().items():
        if name == "embed":  # only the first and last pipeline stages
            continue
        flat = sorted(r for g in lists for r in g)
        assert flat == list(range(lay.world_size)), name


def test_embedding_group_joins_first_and_last_stage():
    assert RankLayout(tp=2, pp=3).group_lists()["embed"] == [[0, 4], [1, 5]]
    assert RankLayout(dp=2).group_lists()["embed"] == [[0], [1]]


def test_expert_groups_are_carved_from_dp():
    lay = RankLayout(tp=1, dp=4, ep=2)
    groups = lay.group_lists()
    assert groups["ep"] == [[0, 1], [2, 3]]
    assert groups["edp"] == [[0, 2], [1, 3]]
    for ep_group in groups["ep"]:
        assert any(set(ep_group) <= set(dp) for dp in groups["dp"])


def test_other_order_moves_tp_outward():
    lay = RankLayout(tp=2, dp=2, order="dp-tp-cp-ep-pp")
    assert lay.group_lists()["tp"] == [[0, 2], [1, 3]]


def test_tp_across_nodes_is_refused_unless_allowed():
    RankLayout(tp=4, dp=2).check_placement(devices_per_node=4, allow_tp_across_nodes=False)
    lay = RankLayout(tp=4, dp=2, order="dp-tp-cp-ep-pp")
    with pytest.raises(ConfigError, match="span nodes"):
        lay.check_placement(devices_per_node=4, allow_tp_across_nodes=False)
    lay.check_placement(devices_per_node=4, allow_tp_across_nodes=True)


@pytest.mark.parametrize("kwargs, key", [(dict(order="tp-dp-pp"), "parallel.order"), (dict(dp=3, ep=2), "parallel.ep")])
def test_bad_layouts(kwargs, key):
    with pytest.raises(ConfigError) as info:
        RankLayout(**kwargs)
    assert info.value.key == key


def _grid_worker():
    import torch
    import torch.distributed as dist

    from threefold.distributed.grid import Grid
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), timeout_s=60)
    grid = Grid.build(RankLayout(tp=2, dp=2))
    # A sum over each group shows the group really contains the ranks the layout names.
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x, group=grid.tp.pg)
    y = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(y, group=grid.dp.pg)
    out = (grid.tp_rank, grid.dp_rank, grid.tp.ranks, grid.dp.ranks, x.item(), y.item())
    shutdown_distributed()
    return out


def test_process_groups_match_layout():
    results = run_ranks(_grid_worker, 4, timeout=90)
    assert results[0] == (0, 0, [0, 1], [0, 2], 1.0, 2.0)
    assert results[3] == (1, 1, [2, 3], [1, 3], 5.0, 4.0)
