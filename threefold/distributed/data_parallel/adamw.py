"""AdamW on flat slices: torch.optim.AdamW's foreach arithmetic op for op, or its fused kernel.

Keeping the exact op sequence of `torch.optim.adam._multi_tensor_adam` (decoupled decay
first, lerp for the first moment, bias corrections as Python floats) makes each element's
update bit-identical to torch's when given the same gradient, so a sharded optimizer differs
from the unsharded one only through gradient reduction order.
"""

from __future__ import annotations

import torch


def adamw_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    decay_views: list[torch.Tensor],
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step, in place. `decay_views` are the parts of `params` that take weight
    decay (matrices, not norms/biases); `step` counts from 1."""
    beta1, beta2 = betas
    if weight_decay != 0 and decay_views:
        torch._foreach_mul_(decay_views, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = (lr / bias_correction1) * -1
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2**0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


def fused_adamw_update(
    groups: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], float]],
    step: torch.Tensor,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """One AdamW step with torch's fused kernel (one launch per group instead of ~9 foreach
    passes): `groups` are (params, grads, exp_avgs, exp_avg_sqs, weight_decay); `step` a 0-d
    fp32 tensor on the device counting from 1, shared by every element. The kernel divides
    the gradients by `grad_scale` and leaves everything untouched where `found_inf` is 1: the
    skip decision stays on the device, so no host sync precedes the update."""
    beta1, beta2 = betas
    for params, grads, exp_avgs, exp_avg_sqs, weight_decay in groups:
        if not params:
            continue
        torch._fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            [step] * len(params),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
