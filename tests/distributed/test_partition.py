import pytest

from threefold.config import build_config
from threefold.distributed.pipeline.partition import balanced_partition, parse_stage_layers, stage_layer_ids
from threefold.errors import ConfigError


def test_equal_cost_layers_split_evenly():
    assert balanced_partition(8, 4, 1.0, 0.0, 0.0) == [2, 2, 2, 2]
    assert balanced_partition(5, 1, 1.0, 0.0, 0.0) == [5]


def test_expensive_head_moves_layers_off_the_last_stage():
    assert balanced_partition(8, 2, 1.0, 0.0, 2.0) == [5, 3]
    assert balanced_partition(6, 3, 1.0, 0.0, 1.0) == [2, 2, 2]


def test_result_minimises_the_slowest_stage_exhaustively():
    import itertools

    layers, stages, first, last = 9, 3, 0.5, 2.5
    best = min(
        max(n * 1.0 + (first if i == 0 else 0) + (last if i == stages - 1 else 0) for i, n in enumerate(c))
        for c in itertools.product(range(1, layers), repeat=stages)
        if sum(c) == layers
    )
    got = balanced_partition(layers, stages, 1.0, first, last)
    cost = max(n + (first if i == 0 else 0) + (last if i == stages - 1 else 0) for i, n in enumerate(got))
    assert sum(got) == layers and cost == best


def test_virtual_stages_cover_every_layer_once_in_order():
    cfg = build_config(None, [("model.layers", "8")]).model
    ids = stage_layer_ids(cfg, pp=2, vpp=2)
    assert [i for stage in ids for i in stage] == list(range(8)) and len(ids) == 4


def test_explicit_layout_and_its_errors():
    assert parse_stage_layers("1,3", 4, 2) == [1, 3]
    for bad in ("1,2", "a,b", "0,4", "1,1,2"):
        with pytest.raises(ConfigError) as info:
            parse_stage_layers(bad, 4, 2)
        assert info.value.key == "parallel.stage_layers"
    with pytest.raises(ValueError, match="at least 5 layers"):
        balanced_partition(4, 5, 1.0, 0.0, 0.0)
