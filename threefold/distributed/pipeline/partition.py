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
    num_layers: int, stages: int, layer_cost: float, first_extra: float, last_extra: float
) -> list[int]:
    """Layer counts per stage (each >= 1) minimising the most expensive stage, then the next
    most expensive, and so on (so equal-cost layers split evenly)."""
    if stages > num_layers:
        raise ValueError(f"{stages} stages need at least {stages} layers, the model has {num_layers}")
    best: dict[tuple[int, int], tuple[list[float], list[int]]] = {}

    def cost(stage: int, n: int) -> float:
        return n * layer_cost + (first_extra if stage == 0 else 0.0) + (last_extra if stage == stages - 1 else 0.0)

    def solve(stage: int, start: int) -> tuple[list[float], list[int]]:
        """Best (stage costs sorted high to low, counts) for stages `stage..` over layers `start..`.
        Comparing the sorted cost vectors minimises the slowest stage first, then the next."""
        key = (stage, start)
        if key not in best:
            left = num_layers - start
            if stage == stages - 1:
                best[key] = ([cost(stage, left)], [left])
            else:
                options = []
                for n in range(1, left - (stages - stage - 1) + 1):
                    tail_costs, tail = solve(stage + 1, start + n)
                    options.append((sorted(tail_costs + [cost(stage, n)], reverse=True), [n] + tail))
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
