"""The MoE layer's routing and expert compute without host syncs (#32): the sort-based routing,
the grouped GEMM and the padded fallback against the layer as it was before (nonzero, bincount,
every expert padded to the largest count), and the host reads one layer makes per micro-batch,
without expert parallelism and at ep 2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from host_reads import HostReads
from torch import nn

from threefold.config import build_config
from threefold.model.moe import MoE, grouped_mm_supported, route
from threefold.validate import validate

from harness import run_ranks

HIDDEN, FFN = 32, 48  # multiples of 4 floats: grouped_mm's 16-byte rule holds in fp32


def moe_cfg(**over):
    """4 experts, top 2, without the balance losses (the gradients compared are the routing's)."""
    pairs = {"model.num_experts": 4, "model.top_k": 2, "model.hidden": HIDDEN, "model.heads": 4}
    pairs.update({"model.kv_heads": 4, "model.ffn_hidden": FFN, "model.aux_loss_coeff": 0, "model.z_loss_coeff": 0})
    pairs.update(over)
    return validate(build_config(None, [(k, str(v)) for k, v in pairs.items()])).model


def moe_layer(seed: int = 0, dtype=torch.float32, **over) -> MoE:
    layer = MoE(moe_cfg(**over))
    gen = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.2).to(dtype)
    with torch.no_grad():  # a hot expert, so that capacity has assignments to drop
        layer.router.weight[0] += 0.3
    return layer


def tokens(seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(16, 3, HIDDEN, generator=torch.Generator().manual_seed(seed)) + 0.5
    return x.to(dtype).requires_grad_()


def layer_before(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer as it was before #32, from the same weights: kept pairs by nonzero, counts
    by bincount, every expert padded to the largest count (read with tolist)."""
    s, b, h = x.shape
    flat = x.reshape(-1, h)
    logits = F.linear(flat.float(), layer.router.weight.float())
    r = route(logits, layer.top_k, layer.capacity_factor, s * b)
    pairs = r.keep.reshape(-1).nonzero().squeeze(1)
    expert = r.expert.reshape(-1)[pairs]
    order = torch.argsort(expert, stable=True)
    pairs, expert = pairs[order], expert[order]
    token = torch.div(pairs, layer.top_k, rounding_mode="floor")
    counts = torch.bincount(expert, minlength=layer.num_experts)
    ex, rows = layer.experts, flat[token]
    width = max(counts.tolist())
    of_row = torch.repeat_interleave(torch.arange(ex.num), counts)
    slot = torch.arange(rows.shape[0]) - (torch.cumsum(counts, 0) - counts)[of_row]
    padded = rows.new_zeros(ex.num, width, h).index_put((of_row, slot), rows)
    hidden = F.silu(ex.w1(padded)) * ex.w3(padded) if ex.gated else F.gelu(ex.w1(padded), approximate="tanh")
    y = ex.w2(hidden)[of_row, slot] * r.weight.reshape(-1)[pairs, None].to(rows.dtype)
    return torch.zeros_like(flat).index_add_(0, token, y).view(s, b, h)


def outputs_and_grads(layer: MoE, x: torch.Tensor, forward=None) -> list[torch.Tensor]:
    """The layer's output, then the gradients of a fixed random projection of it with respect
    to the tokens and every weight."""
    layer.zero_grad()
    x.grad = None
    out = (forward or layer)(x)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.dtype)
    (out * probe).sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]


CASES = {
    "llama dropless": {},
    "llama capacity": {"model.capacity_factor": 1.0},
    "gpt2 capacity": {"model.arch": "gpt2", "model.capacity_factor": 0.75},
}


@pytest.mark.parametrize("case", list(CASES))
def test_padded_path_is_the_layer_before_bit_for_bit(case):
    layer, x = moe_layer(**CASES[case]), tokens()
    layer.experts.gemm = "padded"
    got, before = outputs_and_grads(layer, x), outputs_and_grads(layer, x, lambda t: layer_before(layer, t))
    for a, b in zip(got, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_gemm_matches_the_layer_before_and_the_padded_path(case):
    layer, x = moe_layer(**CASES[case]), tokens()
    assert layer.experts.kernel(x.detach().reshape(-1, HIDDEN)) == "grouped"  # the CPU default
    grouped = outputs_and_grads(layer, x)
    layer.experts.gemm = "padded"
    padded = outputs_and_grads(layer, x)
    before = outputs_and_grads(layer, x, lambda t: layer_before(layer, t))
    for g, p, b in zip(grouped, padded, before):
        assert torch.allclose(g, b, rtol=1e-5, atol=1e-6), (g - b).abs().max()
        assert torch.allclose(g, p, rtol=1e-5, atol=1e-6), (g - p).abs().max()
    if "capacity" in case:  # the dropped rows' masking was exercised
        logits = F.linear(x.detach().reshape(-1, HIDDEN), layer.router.weight)
        assert (~route(logits, layer.top_k, layer.capacity_factor, logits.shape[0]).keep).sum() > 0


def test_grouped_and_padded_agree_in_bf16():
    layer, x = moe_layer(dtype=torch.bfloat16, **{"model.capacity_factor": 1.0}), tokens(dtype=torch.bfloat16)
    assert layer.experts.kernel(x.detach().reshape(-1, HIDDEN)) == "grouped"
    grouped = outputs_and_grads(layer, x)
    layer.experts.gemm = "padded"
    for g, p in zip(grouped, outputs_and_grads(layer, x)):
        assert torch.allclose(g.float(), p.float(), rtol=2e-2, atol=2e-2), (g.float() - p.float()).abs().max()


def test_the_kernel_choice_is_explicit():
    rows = torch.zeros(8, HIDDEN)
    layer = moe_layer()
    assert layer.experts.kernel(rows) == "grouped"
    assert layer.experts.kernel(rows.double()) == "padded"  # grouped_mm takes fp32/bf16/fp16 only
    before = grouped_mm_supported.cache_info()
    layer.experts.kernel(rows)
    assert grouped_mm_supported.cache_info().misses == before.misses  # probed once per device and dtype
    odd = moe_layer(**{"model.ffn_hidden": 50})  # 200-byte rows: not a multiple of 16
    assert odd.experts.kernel(rows) == "padded"
    odd.experts.gemm = "grouped"
    with pytest.raises(ValueError, match="no native path"):
        odd(tokens())
    assert not grouped_mm_supported(torch.device("meta"), torch.float32)


def test_experts_that_receive_no_rows_return_none_and_train_on():
    """An ep rank the router sent nothing (grouped_mm's backward refuses empty inputs)."""
    experts = moe_layer().experts
    x = torch.zeros(0, HIDDEN, requires_grad=True)
    out = experts(x, torch.zeros(experts.num, dtype=torch.long), host_counts=[0] * experts.num)
    out.sum().backward()
    assert out.shape == (0, HIDDEN) and x.grad.shape == (0, HIDDEN)
    assert all(float(p.grad.abs().max()) == 0 for p in experts.parameters())


# --- host reads ---------------------------------------------------------------------------------


def reads_of_one_micro_batch(layer: MoE, x: torch.Tensor) -> dict[str, int]:
    """Host reads of one forward and backward, after a warm-up (the grouped_mm probe is a
    one-time cost). HostReads cannot see inside backward (the autograd engine does not carry
    torch function modes); the only Python there is the all-to-all's backward, whose splits
    are forward's host lists."""
    layer(x).sum().backward()
    with HostReads() as reads:
        layer(x).sum().backward()
    return dict(reads.calls)


@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_an_moe_layer_reads_nothing_on_the_host_without_ep(capacity):
    layer = moe_layer(**{"model.capacity_factor": capacity})
    assert reads_of_one_micro_batch(layer, tokens()) == {}


def test_the_padded_fallback_reads_its_width_once():
    layer = moe_layer(**{"model.capacity_factor": 1.0})
    layer.experts.gemm = "padded"
    assert reads_of_one_micro_batch(layer, tokens()) == {"tolist": 1}


def _ep2_rank(capacity: float, gemm: str) -> tuple[dict, float, float]:
    """One rank of dp 2 x ep 2: the layer's host reads with its experts sharded, and the largest
    relative difference of its output and gradients from the whole layer's on the same tokens (an
    expert's gradient summed over both ranks' tokens, as the exchange sums it), and how many
    assignments capacity dropped."""
    from threefold.distributed import comm
    from threefold.distributed.expert_parallel import apply_expert_parallel
    from threefold.distributed.grid import Grid, RankLayout
    from threefold.distributed.runtime import init_distributed, shutdown_distributed

    init_distributed(torch.device("cpu"), 60)
    try:
        grid = Grid.build(RankLayout(dp=2, ep=2))
        over = {"model.capacity_factor": capacity}
        whole, sharded = moe_layer(**over), moe_layer(**over)
        x = tokens(seed=1 + grid.ep.rank)  # each rank its own batch
        expected = outputs_and_grads(whole, x)
        block, model = nn.Module(), nn.Module()
        block.mlp, model.layers = sharded, nn.ModuleDict({"0": block})
        apply_expert_parallel(model, grid, moe_cfg(**over))
        sharded.experts.gemm = gemm
        local = sharded.experts.num
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                rows = getattr(whole.experts, name).out_features
                mine = slice(grid.ep.rank * local * rows, (grid.ep.rank + 1) * local * rows)
                getattr(sharded.experts, name).weight.copy_(getattr(whole.experts, name).weight[mine])
                grad = comm.all_reduce(getattr(whole.experts, name).weight.grad.clone(), grid.ep)
                expected.append(grad[mine])
        got = outputs_and_grads(sharded, x)
        # Relative to each tensor's scale: the exchange sums the expert gradients in another order.
        diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, expected[:3] + expected[-3:]))
        dropped = float(sharded.pop_stats()[sharded.num_experts])
        return reads_of_one_micro_batch(sharded, x), diff, dropped
    finally:
        shutdown_distributed()


@pytest.mark.parametrize("capacity, gemm", [(0.0, "auto"), (1.0, "auto"), (1.0, "padded")])
def test_expert_parallel_reads_the_split_sizes_once_and_matches_the_whole_layer(capacity, gemm):
    for reads, diff, dropped in run_ranks(_ep2_rank, 2, capacity, gemm, timeout=300):
        assert reads == {"tolist": 1}  # the stacked send/receive counts, nothing else
        assert diff < 1e-5  # observed 4e-7
        assert (dropped > 0) == (capacity > 0)  # capacity's dropped rows were exercised
