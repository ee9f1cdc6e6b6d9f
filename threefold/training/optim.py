"""AdamW with decay groups, warm-up + cosine learning rate, clipping by global gradient norm."""

from __future__ import annotations

import math

import torch
from torch import nn

from threefold.distributed import comm
from threefold.model.sharding import sharding_of


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay; norms, biases and other 1-D parameters do not (GPT-2/Llama practice)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, tcfg) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        param_groups(model, tcfg.weight_decay), lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), eps=1e-8, foreach=True
    )


def lr_at(step: int, tcfg) -> float:
    """Linear warm-up to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    peak, floor = tcfg.lr, tcfg.lr * tcfg.min_lr_ratio
    if step < tcfg.warmup_steps:
        return peak * (step + 1) / tcfg.warmup_steps
    span = max(1, tcfg.steps - tcfg.warmup_steps)
    progress = min(1.0, (step - tcfg.warmup_steps) / span)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def global_grad_norm(model: nn.Module, groups: list, exclude: tuple = ()) -> torch.Tensor:
    """L2 norm of the whole model's gradient, each logical element counted once.

    A parameter split over a group (its sharding record) has its squared sum added over that
    group (divided by `replicas` where several ranks of the group hold the same slice).
    Everything else is replicated there and counted once. The total is then summed over
    `groups` (e.g. the pipeline group: each stage owns different layers).
    """
    device = next(model.parameters()).device
    replicated = torch.zeros((), dtype=torch.float32, device=device)
    per_group: dict[str, list] = {}
    # A tied weight belongs to two modules, and a pipeline's last stage holds a copy of the
    # first stage's embedding (`exclude`): each is counted once.
    seen: set[int] = {id(p) for p in exclude}
    for p in model.parameters():
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        sq = p.grad.detach().float().pow(2).sum()
        s = sharding_of(p)
        if not s.split:
            replicated = replicated + sq
        else:
            entry = per_group.setdefault(s.group.name, [s.group, torch.zeros_like(replicated)])
            entry[1] = entry[1] + sq / s.spec.replicas
    total = replicated
    for group, sq in per_group.values():
        total = total + comm.all_reduce(sq, group)
    for group in groups:
        comm.all_reduce(total, group)
    return total.sqrt()


def clip_gradients(model: nn.Module, max_norm: float, norm: torch.Tensor) -> None:
    """Scale all gradients so the global norm is at most `max_norm` (no-op when max_norm <= 0)."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, coef)
