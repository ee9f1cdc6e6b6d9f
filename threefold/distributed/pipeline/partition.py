"""Which layers each pipeline stage holds.

Layers are cut into `pp * vpp` contiguous virtual stages. Virtual stage s lives on pipeline
rank s % pp as its chunk s // pp (Megatron's interleaved placement), so with vpp = 1 stage s
is simply rank s. The cut balances cost, not layer count: the first stage also pays for the
embedding and the last for the final norm, the vocabulary head and the loss, which for small
models can be worth several layers.
"""

from __future__ import annotations

from threefold.config import ModelConfig
from threefold.errors import ConfigError


def stage_costs(cfg: ModelConfig) -> tuple[float, float, float]:
    """(per-layer, first-stage extra, last-stage extra) forward FLOPs per token."""
    from threefold.model.flops import attention_flops_per_token_per_layer, matmul_weights_per_layer

    layer = 2.0 * matmul_weights_per_layer(cfg) + attention_flops_per_token_per_layer(cfg)
    head = 2.0 * cfg.hidden * cfg.vocab
    embed = 0.0  # a lookup: no matmul work
    return layer, embed, head


def balanced_partition(
    num_layers: int,
    stages: int,
    layer_cost: float,
    first_extra: float,
    last_extra: float,
    speeds: list[float] | None = None,
    layer_weights: list[float] | None = None,
) -> list[int]:
    """Layer counts per stage (each >= 1) minimising the most expensive stage, then the next
    most expensive, and so on (so equal-cost layers split evenly).

    Uneven hardware or layers (train.on_slow rebalance): `speeds` per stage (cost units per
    second, any scale) divide each stage's cost, so a stage measured at half the speed of the
    others gets about half their work; `layer_weights` per global layer scale that layer's cost (a
    layer measured slower than its siblings stays slow wherever it goes)."""
    if stages > num_layers:
        raise ValueError(f"{stages} stages need at least {stages} layers, the model has {num_layers}")
    best: dict[tuple[int, int], tuple[list[float], list[int]]] = {}
    weights = layer_weights or [1.0] * num_layers
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(stage: int, n: int, start: int) -> float:
        own = (prefix[start + n] - prefix[start]) * layer_cost
        own += (first_extra if stage == 0 else 0.0) + (last_extra if stage == stages - 1 else 0.0)
        return own / speeds[stage] if speeds else own

    def solve(stage: int, start: int) -> tuple[list[float], list[int]]:
        """Best (stage costs sorted high to low, counts) for stages `stage..` over layers `start..`.
        Comparing the sorted cost vectors minimises the slowest stage first, then the next."""
        key = (stage, start)
        if key not in best:
            left = num_layers - start
            if stage == stages - 1:
                best[key] = ([cost(stage, left, start)], [left])
            else:
                options = []
                for n in range(1, left - (stages - stage - 1) + 1):
                    tail_costs, tail = solve(stage + 1, start + n)
                    options.append((sorted(tail_costs + [cost(stage, n, start)], reverse=True), [n] + tail))
                best[key] = min(options)
        return best[key]

    return solve(0, 0)[1]


def parse_stage_layers(text: str, num_layers: int, stages: int) -> list[int]:
    """An explicit user layout such as "3,4,4,3": layer counts per virtual stage."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(
            "parallel.stage_layers", f"{text!r} is not a comma-separated list of integers", "e.g. 3,4,4,3"
        ) from None
    if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
        raise ConfigError(
            "parallel.stage_layers",
            f"{text!r} must give {stages} positive counts summing to model.layers ({num_layers})",
            "one count per pp*vpp virtual stage",
        )
    return counts


def stage_layer_ids(cfg: ModelConfig, pp: int, vpp: int, explicit: str = "") -> list[list[int]]:
    """Global layer indices of each virtual stage, in virtual-stage order."""
    stages = pp * vpp
    if explicit:
        counts = parse_stage_layers(explicit, cfg.layers, stages)
    else:
        counts = balanced_partition(cfg.layers, stages, *stage_costs(cfg))
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def virtual_stage(pp_rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + pp_rank


def stage_times(
    counts: list[int], layer_cost: float, first_extra: float, last_extra: float, speeds=None, layer_weights=None
) -> list[float]:
    """Each stage's modelled time (cost over speed) under the layer counts `counts`: what
    balanced_partition minimises, for comparing a partition with the current one."""
    weights = layer_weights or [1.0] * sum(counts)
    out, start = [], 0
    for stage, n in enumerate(counts):
        own = sum(weights[start : start + n]) * layer_cost + (first_extra if stage == 0 else 0.0)
        own += last_extra if stage == len(counts) - 1 else 0.0
        out.append(own / speeds[stage] if speeds else own)
        start += n
    return out


def stage_counts(cfg: ModelConfig, pp: int, vpp: int, explicit: str = "") -> list[int]:
    """Layer counts per virtual stage: the user's parallel.stage_layers, else the balanced cut."""
    return [len(ids) for ids in stage_layer_ids(cfg, pp, vpp, explicit)]


def partition_for_speeds(
    cfg: ModelConfig, pp: int, counts: list[int], compute_s: list[float], layer_weights: list[float] | None = None
) -> tuple[list[int], list[float], list[float]]:
    """An uneven partition from measured compute: (new layer counts per virtual stage, each
    pipeline rank's speed relative to the fastest, each rank's predicted compute seconds under the
    new counts). `counts`: the current counts per virtual stage (pp * vpp of them); `compute_s`:
    each pipeline rank's measured compute seconds per step under them. A rank's speed is the
    planner's cost of what it holds over the time it took (so a stage heavy only because it holds
    more layers is as fast as the rest, and gets the balanced cut back); `layer_weights` (a layer
    measured slower than its siblings) scale single layers' costs."""
    layer, first, last = stage_costs(cfg)
    stages = len(counts)
    costs = stage_times(counts, layer, first, last, None, layer_weights)
    held = [sum(costs[v] for v in range(stages) if v % pp == r) for r in range(pp)]
    speeds = [held[r] / max(compute_s[r], 1e-12) for r in range(pp)]
    top = max(speeds)
    speeds = [s / top for s in speeds]
    per_stage = [speeds[v % pp] for v in range(stages)]
    new = balanced_partition(sum(counts), stages, layer, first, last, per_stage, layer_weights)
    # Predicted seconds: the modelled time at the measured speeds, in the measured units.
    scale = compute_s[speeds.index(1.0)] / held[speeds.index(1.0)]
    times = stage_times(new, layer, first, last, per_stage, layer_weights)
    predicted = [scale * sum(times[v] for v in range(stages) if v % pp == r) for r in range(pp)]
    return new, speeds, predicted
