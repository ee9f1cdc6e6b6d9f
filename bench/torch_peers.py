"""The PyTorch peers' optimizer and gradient clipping at their best, for models whose parameters
are DTensors (tensor parallelism, FSDP2) and possibly plain tensors too.

torch's foreach kernels (AdamW, norms, the clipping multiply) refuse a list mixing DTensors and
plain tensors, or DTensors on different device meshes, and foreach=False pays DTensor's
per-parameter dispatch for every tensor. So the parameters are split by kind (plain tensors;
DTensors per device mesh) and each kind gets its own AdamW(foreach=True), its own foreach norm
and its own foreach clip, the way torchtitan computes the global norm: per-mesh norms made
whole with full_tensor(), squared, summed (and summed over the pipeline group where stages
hold different layers), square root.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from threefold.training.optim import param_groups


def kind_of(p: torch.Tensor):
    """The key a foreach kernel can batch under: None for a plain tensor, else the DTensor's mesh."""
    return p.device_mesh if isinstance(p, DTensor) else None


def kind_name(kind) -> str:
    if kind is None:
        return "plain tensors"
    names = kind.mesh_dim_names or [f"dim{i}" for i in range(kind.ndim)]
    return "DTensor on mesh (" + ", ".join(f"{n} {s}" for n, s in zip(names, kind.shape)) + ")"


class MeshOptimizer:
    """AdamW(foreach=True) per parameter kind, with the global gradient norm and clipping over all."""

    def __init__(self, model: nn.Module, tcfg, norm_groups: tuple = ()):
        # threefold's decay rule (matrices decay, 1-D parameters do not), applied within each kind.
        self.kinds: dict = {}
        for group in param_groups(model, tcfg.weight_decay):
            for p in group["params"]:
                groups = self.kinds.setdefault(kind_of(p), {})
                groups.setdefault(group["weight_decay"], []).append(p)
        self.optimizers = [
            torch.optim.AdamW(
                [{"params": ps, "weight_decay": wd} for wd, ps in groups.items()],
                lr=tcfg.lr,
                betas=(tcfg.beta1, tcfg.beta2),
                eps=1e-8,
                foreach=True,
            )
            for groups in self.kinds.values()
        ]
        self.params = [[p for ps in groups.values() for p in ps] for groups in self.kinds.values()]
        self.norm_groups = norm_groups  # process groups holding other parameters (e.g. pipeline stages)

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of every gradient of the model (and of `norm_groups`' ranks), as a plain tensor."""
        sq = torch.zeros((), dtype=torch.float32)
        for params in self.params:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                norm = torch.nn.utils.get_total_norm(grads, foreach=True)
                norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                sq = sq + norm.float() ** 2
        for group in self.norm_groups:
            dist.all_reduce(sq, group=group)
        return sq.sqrt()

    def clip(self, max_norm: float, norm: torch.Tensor) -> None:
        if max_norm > 0:
            for params in self.params:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def state_tensors(self) -> list[torch.Tensor]:
        """Optimizer state (moments) of every kind, local shards for DTensors."""
        return [
            v.to_local() if isinstance(v, DTensor) else v
            for opt in self.optimizers
            for s in opt.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        ]

    def describe(self) -> str:
        kinds = "; ".join(f"{kind_name(k)}: {len(ps)} parameters" for k, ps in zip(self.kinds, self.params))
        return (
            f"{len(self.optimizers)} x AdamW(foreach=True), one per parameter kind ({kinds}); "
            "get_total_norm(foreach=True) per kind, full_tensor(), combined as sqrt(sum of squares)"
            + (" and summed over the pipeline group" if self.norm_groups else "")
            + "; clip_grads_with_norm_(foreach=True) per kind"
        )
