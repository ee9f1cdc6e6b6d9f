"""Mixture of experts: a top-k softmax router and experts computed as one grouped GEMM.

    x -> router (fp32 logits) -> softmax -> top-k experts per token (+ weights)
      -> capacity rule (optional dropping) -> assignments sorted by expert (dropped ones last)
      -> dispatcher.run(rows, counts, experts)   (local here; all-to-all under expert parallelism)
      -> weighted sum of each token's expert outputs (+ shared expert)

Nothing on this path waits for the device: the sort has a fixed size (all tokens x top_k
assignments, dropped ones sorted last), the counts are a scatter-add, and the experts run as
one `torch._grouped_mm` over the sorted rows, cut by offsets that stay on the device. Where
that kernel is not the device's fast path, the experts fall back to one batched matmul over
rows padded to the largest count, which reads that count on the host once (`Experts.gemm`).
Expert parallelism adds the one read its all-to-all needs: the split sizes.

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

import functools
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
        return torch.bmm(x, self._per_expert())

    def grouped(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [rows, in], rows [offsets[e-1], offsets[e]) for expert e -> [rows, out]; rows past
        offsets[-1] belong to no expert and their outputs are left unwritten."""
        weight = self._per_expert()
        if weight.data_ptr() % _GROUPED_ALIGN:  # a view into a flat buffer at an odd offset
            weight = weight.clone()
        return torch._grouped_mm(x, weight, offs=offsets)

    def _per_expert(self) -> torch.Tensor:
        return self.weight.view(self.num, self.out_features, self.in_features).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"experts={self.num}, in={self.in_features}, out={self.out_features}"


GEMMS = ("auto", "grouped", "padded")
_GROUPED_ALIGN = 16  # bytes: grouped_mm's rule for every stride and base address


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs on `device` in `dtype` without waiting for it. On CUDA
    that is its CUTLASS path (bf16 on compute capability 9.x/10.x): elsewhere it falls back
    to a loop that reads the offsets on the host. On CPU the loop is host code anyway (no
    device queue to drain), so any dtype the kernel takes is probed once with a tiny run,
    backward included."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        major = torch.cuda.get_device_capability(device)[0]
        return torch.version.hip is None and dtype == torch.bfloat16 and major in (9, 10)
    if device.type != "cpu":
        return False
    # The first call may come from inside a checkpointed forward (full recompute): the probe's
    # own saved tensors must not be packed by checkpoint's hooks, or the forward saves more
    # tensors than its rerun (which finds the answer cached) and the rerun fails.
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            x = torch.ones(2, 8, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 8, 8, dtype=dtype, requires_grad=True)
            y = torch._grouped_mm(x, w, offs=torch.tensor([1, 2], dtype=torch.int32))
            y.backward(torch.ones_like(y))  # a dense gradient: its backward refuses expanded ones
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


class Experts(nn.Module):
    """The routed experts held here (all of them, or this rank's share under EP): SwiGLU for
    llama, GeLU for gpt2, without biases.

    `gemm` picks how they compute: "grouped" (one grouped GEMM over the rows sorted by
    expert: no padding, no host read), "padded" (rows padded into one [experts, largest
    count, hidden] batched matmul: the largest count is read on the host), or "auto": grouped
    where the device runs it natively for this dtype and hidden/ffn_hidden meet its 16-byte
    alignment, padded elsewhere."""

    def __init__(self, cfg: ModelConfig, num: int | None = None, gemm: str = "auto"):
        super().__init__()
        if gemm not in GEMMS:
            raise ValueError(f"Experts gemm {gemm!r}: valid are {', '.join(GEMMS)}")
        num = cfg.num_experts if num is None else num
        self.num, self.gated, self.gemm = num, cfg.arch == "llama", gemm
        self.w1 = StackedLinear(num, cfg.hidden, cfg.ffn_hidden)
        self.w3 = StackedLinear(num, cfg.hidden, cfg.ffn_hidden) if self.gated else None
        self.w2 = StackedLinear(num, cfg.ffn_hidden, cfg.hidden)

    def kernel(self, x: torch.Tensor) -> str:
        """The kernel forward runs for rows like `x`: "grouped" or "padded"."""
        if self.gemm == "padded":
            return "padded"
        bytes_per_row = [self.w1.in_features * x.element_size(), self.w1.out_features * x.element_size()]
        native = (
            grouped_mm_supported(x.device, x.dtype)
            and x.dtype == self.w1.weight.dtype
            and all(b % _GROUPED_ALIGN == 0 for b in bytes_per_row)
        )
        if self.gemm == "grouped" and not native:
            raise ValueError(
                f"Experts gemm 'grouped': torch._grouped_mm has no native path for {x.dtype} on {x.device} "
                f"with hidden {self.w1.in_features}, ffn_hidden {self.w1.out_features}"
            )
        return "grouped" if native else "padded"

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor, host_counts: list[int] | None = None, may_drop: bool = False
    ) -> torch.Tensor:
        """x [rows, hidden]: assignments sorted by local expert, counts[e] of them (a device
        tensor) for expert e -> outputs [rows, hidden], same order. With `may_drop`, rows past
        counts.sum() may follow (dropped by the capacity rule): their outputs are zeros.
        `host_counts`: the same counts already read on the host (the EP dispatcher's), which
        the padded path then need not read again."""
        if x.shape[0] == 0:  # grouped_mm's backward refuses empty inputs
            return self._padded(x, counts, [0] * self.num)
        if self.kernel(x) == "grouped":
            return self._grouped(x, counts, may_drop)
        return self._padded(x, counts, host_counts)

    def _mlp(self, x: torch.Tensor, linear) -> torch.Tensor:
        if self.gated:
            h = F.silu(linear(self.w1, x)) * linear(self.w3, x)
        else:
            h = F.gelu(linear(self.w1, x), approximate="tanh")
        return linear(self.w2, h)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor, may_drop: bool) -> torch.Tensor:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        if not may_drop:
            return self._mlp(x, lambda w, t: w.grouped(t, offsets))
        # Dropped rows lie past the last offset, in no group: grouped_mm leaves their outputs
        # and, in backward, their input gradients unwritten. Both sides are masked, so neither
        # the layer's sum nor the tokens' gradients see that memory.
        kept = (torch.arange(x.shape[0], device=x.device) < offsets[-1])[:, None]
        y = self._mlp(torch.where(kept, x, 0), lambda w, t: w.grouped(t, offsets))
        return torch.where(kept, y, 0)

    def _padded(self, x: torch.Tensor, counts: torch.Tensor, host_counts: list[int] | None) -> torch.Tensor:
        if host_counts is None:  # this path's one host read: the batch's shape depends on it
            width, total = torch.stack([counts.max(), counts.sum()]).tolist()
        else:
            width, total = max(host_counts, default=0), sum(host_counts)
        expert = torch.repeat_interleave(torch.arange(self.num, device=x.device), counts, output_size=total)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(total, device=x.device) - starts[expert]
        padded = x.new_zeros(self.num, width, x.shape[-1]).index_put((expert, slot), x[:total])
        y = self._mlp(padded, lambda w, t: w(t))[expert, slot]
        if total == x.shape[0]:
            return y
        return torch.cat([y, y.new_zeros(x.shape[0] - total, y.shape[-1])])


class LocalDispatcher:
    """Every expert is here: the sorted rows go straight through."""

    def run(self, x: torch.Tensor, counts: torch.Tensor, experts: Experts, may_drop: bool = False) -> torch.Tensor:
        return experts(x, counts, may_drop=may_drop)


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
        # Every assignment sorted by expert (stable: token order within an expert), the dropped
        # ones under a key past the last expert, so they sort last: shapes do not depend on
        # routing, and the kept rows come in the order they always had.
        dropping = self.capacity_factor > 0
        expert = r.expert.reshape(-1)
        key = torch.where(r.keep.reshape(-1), expert, self.num_experts) if dropping else expert
        order = torch.argsort(key, stable=True)
        token = torch.div(order, self.top_k, rounding_mode="floor")
        kept = r.keep.reshape(-1).to(torch.long)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(0, expert, kept)
        y = self.dispatcher.run(flat[token], counts, self.experts, dropping)  # dropped rows: zeros
        y = y * r.weight.reshape(-1)[order, None].to(y.dtype)
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
