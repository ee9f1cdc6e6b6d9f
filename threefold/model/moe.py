"""Mixture of experts: a top-k softmax router and experts computed as one batched matmul.

    x -> router (fp32 logits) -> softmax -> top-k experts per token (+ weights)
      -> capacity rule (optional dropping) -> tokens sorted by expert
      -> dispatcher.run(tokens, counts, experts)   (local here; all-to-all under expert parallelism)
      -> weighted sum of each token's expert outputs (+ shared expert)

Balance is enforced by the Switch/GShard load-balancing loss E * sum_e f_e * P_e (f_e: share
of routed assignments to expert e, P_e: mean router probability of e; 1.0 when balanced) and
the router z-loss mean(logsumexp(logits)^2) (ST-MoE). They are not returned through the
pipeline: their gradient is injected into backward at the layer (`_AddLossGrad`), weighted by
`aux_weight` that the trainer sets per step (1 / micro-batches of the global batch, times
the loss scale), so every micro-batch contributes its mean.

Capacity (GShard): expert e takes at most C = ceil(capacity_factor * tokens * top_k / E)
assignments of a micro-batch; assignments queue by choice rank first (all first choices
before any second choice), then by token position; the rest are dropped (the token keeps its
residual). capacity_factor 0 is dropless.

Parallel plumbing stays outside: tensor parallelism makes the TP ranks split the
micro-batch's tokens (`split_tokens`/`gather_tokens`) and hands in `gather_counts`, so the
routing rules still hold over the whole micro-batch; expert parallelism swaps `dispatcher` and shrinks `experts` to this
rank's share. Expert weights are stored 2-D ([experts * out, in]) so initialization,
checkpoints and sharding treat them like any row-sharded matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig
from threefold.model.recompute import is_recomputing


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Every `moe_every`-th block (0-based layers k-1, 2k-1, ...) is MoE when num_experts > 0."""
    return cfg.num_experts > 0 and layer % cfg.moe_every == cfg.moe_every - 1


class StackedLinear(nn.Module):
    """`num` experts' weights of one projection, stacked row-wise: [num * out, in]."""

    def __init__(self, num: int, in_features: int, out_features: int):
        super().__init__()
        self.num, self.in_features, self.out_features = num, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num * out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num, rows, in] -> [num, rows, out]: one batched matmul for all experts."""
        return torch.bmm(x, self.weight.view(self.num, self.out_features, self.in_features).transpose(1, 2))

    def extra_repr(self) -> str:
        return f"experts={self.num}, in={self.in_features}, out={self.out_features}"


class Experts(nn.Module):
    """The routed experts held here (all of them, or this rank's share under EP): SwiGLU for
    llama, GeLU for gpt2, without biases."""

    def __init__(self, cfg: ModelConfig, num: int | None = None):
        super().__init__()
        num = cfg.num_experts if num is None else num
        self.num, self.gated = num, cfg.arch == "llama"
        self.w1 = StackedLinear(num, cfg.hidden, cfg.ffn_hidden)
        self.w3 = StackedLinear(num, cfg.hidden, cfg.ffn_hidden) if self.gated else None
        self.w2 = StackedLinear(num, cfg.ffn_hidden, cfg.hidden)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: rows sorted by local expert, counts[e] of them for expert e -> outputs, same order.
        Rows are padded into one [experts, max count, hidden] batch (no loop over tokens)."""
        n = counts.tolist()  # split sizes are host values (a sync on accelerators, as any dropless MoE)
        width = max(n) if n else 0
        expert = torch.repeat_interleave(torch.arange(self.num, device=x.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
        padded = x.new_zeros(self.num, width, x.shape[-1]).index_put((expert, slot), x)
        if self.gated:
            h = F.silu(self.w1(padded)) * self.w3(padded)
        else:
            h = F.gelu(self.w1(padded), approximate="tanh")
        return self.w2(h)[expert, slot]


class LocalDispatcher:
    """Every expert is here: the sorted tokens go straight through."""

    def run(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        return experts(x, counts)


@dataclass
class Routing:
    """One micro-batch's routing of its T local tokens (K choices each)."""

    expert: torch.Tensor  # [T, K] global expert ids
    weight: torch.Tensor  # [T, K] combine weights (fp32)
    keep: torch.Tensor  # [T, K] bool: within capacity
    counts: torch.Tensor  # [E] assignments routed here (before dropping), local tokens
    aux: torch.Tensor  # load-balancing loss, this rank's part (sums to the whole over the token ranks)
    z: torch.Tensor  # z-loss, this rank's part


def route(
    logits: torch.Tensor, top_k: int, capacity_factor: float, total_tokens: int, gather_counts=None, token_rank: int = 0
) -> Routing:
    """Top-k routing of `logits` [T, E] (fp32), with the balance losses and the capacity rule
    computed over the whole micro-batch of `total_tokens`. When ranks split the micro-batch
    (tensor parallelism), `gather_counts` stacks every rank's per-choice counts [ranks, K, E]
    and `token_rank` is our place among them (our tokens follow those of lower ranks)."""
    tokens, experts = logits.shape
    probs = logits.softmax(-1)
    top_p, top_e = probs.topk(top_k, dim=-1)
    weight = top_p / top_p.sum(-1, keepdim=True) if top_k > 1 else top_p
    # Assignments in queue order: choice rank first, then token position.
    onehot = F.one_hot(top_e.t().reshape(-1), experts)  # [K*T, E]
    per_choice = onehot.view(top_k, tokens, experts).sum(1)  # [K, E]
    every = per_choice[None] if gather_counts is None else gather_counts(per_choice)  # [ranks, K, E]
    counts_all = every.sum((0, 1)).to(torch.float32)  # [E] over the whole micro-batch
    # Switch loss: f_e is a constant (counts); the gradient reaches the router through P_e.
    f = counts_all / (total_tokens * top_k)
    aux = experts * (f * probs.sum(0)).sum() / total_tokens
    z = torch.logsumexp(logits, -1).pow(2).sum() / total_tokens
    keep = torch.ones_like(top_e, dtype=torch.bool)
    if capacity_factor > 0:
        capacity = math.ceil(capacity_factor * total_tokens * top_k / experts)
        position = (torch.cumsum(onehot, 0) * onehot).sum(-1).view(top_k, tokens) - 1  # local queue place
        r = token_rank
        earlier_choices = torch.cumsum(every, 1) - every  # [ranks, K, E]: assignments of choices < k
        offset = earlier_choices.sum(0) - earlier_choices[r] + every[:r].sum(0)  # other ranks ahead of us
        position = position + offset.gather(1, top_e.t())
        keep = (position < capacity).t()
    return Routing(top_e, weight, keep, per_choice.sum(0), aux, z)


class _AddLossGrad(torch.autograd.Function):
    """Identity on `out`; in backward, d(loss)/d(loss) = 1 enters the graph of `loss`."""

    @staticmethod
    def forward(ctx, out, loss):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.aux_coeff, self.z_coeff = cfg.aux_loss_coeff, cfg.z_loss_coeff
        self.router = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        self.shared = shared
        self.dispatcher = LocalDispatcher()
        # Tensor parallelism: how many ranks split this micro-batch's tokens and our place among
        # them, how whole tokens are split and re-gathered (identity when they arrive split, under
        # SP), and how every rank's routing counts are gathered (None: all tokens are here).
        self.token_ranks, self.token_rank = 1, 0
        self.split_tokens = self.gather_tokens = _identity
        self.gather_counts = None
        self.aux_weight = 1.0  # set per step by the trainer
        self.stats: torch.Tensor | None = None  # per expert: routed count; then dropped, aux, z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [seq, batch, hidden] -> same shape."""
        full = x
        x = self.split_tokens(x)
        s, b, h = x.shape
        flat = x.reshape(-1, h)
        logits = F.linear(flat.float(), self.router.weight.float())
        r = route(
            logits, self.top_k, self.capacity_factor, s * b * self.token_ranks, self.gather_counts, self.token_rank
        )
        # Kept assignments sorted by expert (stable: token order within an expert).
        pairs = r.keep.reshape(-1).nonzero().squeeze(1)
        expert = r.expert.reshape(-1)[pairs]
        order = torch.argsort(expert, stable=True)
        pairs, expert = pairs[order], expert[order]
        token = torch.div(pairs, self.top_k, rounding_mode="floor")
        counts = torch.bincount(expert, minlength=self.num_experts)
        y = self.dispatcher.run(flat[token], counts, self.experts)
        y = y * r.weight.reshape(-1)[pairs, None].to(y.dtype)
        out = torch.zeros_like(flat).index_add_(0, token, y)
        if torch.is_grad_enabled() and (self.aux_coeff or self.z_coeff):
            out = _AddLossGrad.apply(out, self.aux_weight * (self.aux_coeff * r.aux + self.z_coeff * r.z))
        self._record(r)
        out = self.gather_tokens(out.view(s, b, h))
        return out if self.shared is None else out + self.shared(full)

    @torch.no_grad()
    def _record(self, r: Routing) -> None:
        if is_recomputing():  # a rerun in backward routes the same tokens again: count once
            return
        dropped = (~r.keep).sum().to(torch.float32)
        row = torch.cat([r.counts.to(torch.float32), torch.stack([dropped, r.aux.detach(), r.z.detach()])])
        self.stats = row if self.stats is None else self.stats + row

    def pop_stats(self) -> torch.Tensor:
        """Sums since the last call: [E routed counts..., dropped, aux, z] (this rank's tokens)."""
        out = self.stats if self.stats is not None else torch.zeros(self.num_experts + 3)
        self.stats = None
        return out


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """Global layer index -> MoE of the blocks `model` (a Transformer or pipeline chunk) holds."""
    layers = getattr(model, "layers", {})
    return {int(i): b.mlp for i, b in layers.items() if isinstance(getattr(b, "mlp", None), MoE)}


def expert_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The routed experts' weights: replicated over a different group than the dense ones."""
    return [p for m in modules for sub in m.modules() if isinstance(sub, Experts) for p in sub.parameters()]
