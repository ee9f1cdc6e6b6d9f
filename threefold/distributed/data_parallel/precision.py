"""Mixed-precision policy and dynamic loss scaling.

The model's working parameters (and so its activations and autograd gradients) are in
`param_dtype`; gradients are accumulated and reduced over dp in `reduce_dtype`, fp32 unless
set (Megatron's fp32 main grads: summing many micro-batches' and ranks' bf16 gradients in bf16
drops their low bits; 2 extra bytes per parameter under bf16/fp16, and twice the dp traffic); the
optimizer always keeps fp32 master weights and fp32 Adam moments (the 12 bytes/parameter of
the ZeRO paper). fp16 has a narrow exponent range, so it needs loss scaling: the loss is
multiplied by a scale before backward, and a step whose gradients overflowed is skipped and
the scale halved (Micikevicius et al., "Mixed Precision Training").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from threefold.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MixedPrecision:
    """param_dtype: model weights/activations; reduce_dtype: gradient buffers and dp reduction
    (None = fp32); loss_scale: None, "dynamic", or a fixed float."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    loss_scale: str | float | None = None
    initial_scale: float = 2.0**16
    growth_interval: int = 1000  # good steps in a row before the dynamic scale doubles

    def __post_init__(self) -> None:
        if self.param_dtype not in DTYPES.values():
            raise ConfigError("train.dtype", f"{self.param_dtype} is not supported", "fp32, bf16 or fp16")
        if self.reduce_dtype is not None and self.reduce_dtype not in DTYPES.values():
            raise ConfigError("train.grad_reduce_dtype", f"{self.reduce_dtype} is not supported", "fp32, bf16 or fp16")
        if self.param_dtype == torch.float16 and self.loss_scale is None:
            raise ConfigError(
                "train.loss_scale",
                "fp16 training without loss scaling underflows gradients",
                "set train.loss_scale dynamic (or a fixed power of two), or use bf16",
            )
        if isinstance(self.loss_scale, str) and self.loss_scale != "dynamic":
            raise ConfigError("train.loss_scale", f"{self.loss_scale!r} is not a scale", "dynamic or a number > 0")
        if isinstance(self.loss_scale, (int, float)) and not self.loss_scale > 0:
            raise ConfigError("train.loss_scale", f"{self.loss_scale} must be > 0", "dynamic or a number > 0")
        if self.growth_interval < 1:
            raise ConfigError("train.loss_scale_window", f"{self.growth_interval} must be >= 1")
        if not self.initial_scale > 0:
            raise ConfigError("train.initial_loss_scale", f"{self.initial_scale} must be > 0")

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.reduce_dtype or torch.float32

    @classmethod
    def from_names(
        cls,
        dtype: str,
        reduce_dtype: str = "auto",
        loss_scale: str = "auto",
        initial_scale: float = 2.0**16,
        growth_interval: int = 1000,
    ) -> MixedPrecision:
        """From config strings: dtype fp32|bf16|fp16; reduce_dtype auto (= fp32)|fp32|bf16|fp16;
        loss_scale auto (dynamic for fp16, none otherwise)|none|dynamic|<number>; a dynamic
        scale starts at `initial_scale` and doubles after `growth_interval` clean steps."""
        if dtype not in DTYPES:
            raise ConfigError("train.dtype", f"{dtype!r} is not a dtype", "fp32, bf16 or fp16")
        if reduce_dtype != "auto" and reduce_dtype not in DTYPES:
            raise ConfigError("train.grad_reduce_dtype", f"{reduce_dtype!r} is not a dtype", "auto, fp32, bf16 or fp16")
        if loss_scale == "auto":
            scale = "dynamic" if dtype == "fp16" else None
        elif loss_scale == "none":
            scale = None
        elif loss_scale == "dynamic":
            scale = "dynamic"
        else:
            try:
                scale = float(loss_scale)
            except ValueError:
                raise ConfigError(
                    "train.loss_scale", f"{loss_scale!r} is not a scale", "auto, none, dynamic or a number"
                ) from None
        return cls(
            DTYPES[dtype],
            None if reduce_dtype == "auto" else DTYPES[reduce_dtype],
            scale,
            float(initial_scale),
            int(growth_interval),
        )


class LossScaler:
    """Static or dynamic loss scale. `update(finite)` after each step says whether to apply it."""

    def __init__(self, policy: MixedPrecision):
        self.dynamic = policy.loss_scale == "dynamic"
        if policy.loss_scale is None:
            self.scale = 1.0
        else:
            self.scale = policy.initial_scale if self.dynamic else float(policy.loss_scale)
        self.growth_interval = policy.growth_interval
        self.good_steps = 0
        self.skipped = 0

    @property
    def enabled(self) -> bool:
        return self.dynamic or self.scale != 1.0

    def update(self, grad_norm: float) -> bool:
        """True when the step may be applied. A non-finite norm means some gradient overflowed:
        skip, halve a dynamic scale; after `growth_interval` clean steps, double it."""
        if math.isfinite(grad_norm):
            self.good_steps += 1
            if self.dynamic and self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
            return True
        self.skipped += 1
        self.good_steps = 0
        if self.dynamic:
            self.scale = max(self.scale / 2.0, 1.0)
        return False

    def state_dict(self) -> dict:
        return {"dynamic": self.dynamic, "scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved dynamic scale (a checkpoint's); a static or absent one is not carried
        over: the configured scale stands."""
        if self.dynamic and state.get("dynamic"):
            self.scale, self.good_steps, self.skipped = state["scale"], state["good_steps"], state["skipped"]
