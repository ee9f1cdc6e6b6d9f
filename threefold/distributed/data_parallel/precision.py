"""Mixed-precision policy and dynamic loss scaling.

The model's working parameters (and so its activations and autograd gradients) are in
`param_dtype`; gradients are accumulated and reduced over dp in `reduce_dtype`, fp32 unless
set (Megatron's fp32 main grads: summing many micro-batches' and ranks' bf16 gradients in bf16
drops their low bits; 2 extra bytes per parameter under bf16/fp16, and twice the dp traffic); the
optimizer always keeps fp32 master weights and fp32 Adam moments (the 12 bytes/parameter of
the ZeRO paper). fp16 has a narrow exponent range, so it needs loss scaling: the loss is
multiplied by a scale before backward, and a step whose gradients overflowed is skipped and
the scale halved (Micikevicius et al., "Mixed Precision Training").

The scale lives on the device and is decided there, as torch's GradScaler does: the step's
found-inf flag (a non-finite global norm) is the one the fused AdamW kernel skips the update
with, and `torch._amp_update_scale_` halves the scale on it or doubles it after
`growth_interval` clean steps, without the host reading anything.
"""

from __future__ import annotations

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
    """Static or dynamic loss scale, a 0-d fp32 tensor on `device` (`scale`). `update(found_inf)`
    after each step, on the device: a dynamic scale halves on an overflow (never below 1) and
    doubles after `growth_interval` clean steps in a row."""

    def __init__(self, policy: MixedPrecision, device: torch.device | str = "cpu"):
        self.dynamic = policy.loss_scale == "dynamic"
        if policy.loss_scale is None:
            value = 1.0
        else:
            value = policy.initial_scale if self.dynamic else float(policy.loss_scale)
        self.enabled = self.dynamic or value != 1.0
        self.growth_interval = policy.growth_interval
        self.scale = torch.full((), value, dtype=torch.float32, device=device)
        self.good_steps = torch.zeros((), dtype=torch.int32, device=device)
        """Clean steps since the last overflow or growth (GradScaler's growth tracker)."""
        self.skipped = torch.zeros((), dtype=torch.float32, device=device)

    def update(self, found_inf: torch.Tensor) -> None:
        """The step's verdict (`found_inf`: 0-d fp32, 1 = some gradient overflowed and the update
        was skipped), applied on the device."""
        self.skipped += found_inf
        if self.dynamic:
            torch._amp_update_scale_(self.scale, self.good_steps, found_inf, 2.0, 0.5, self.growth_interval)
            self.scale.clamp_(min=1.0)

    def value(self) -> float:
        """The scale now: a host read (on CUDA it waits for the device; never on a step's path)."""
        return float(self.scale)

    def state_dict(self) -> dict:
        """A host read (a checkpoint's)."""
        return {
            "dynamic": self.dynamic,
            "scale": float(self.scale),
            "good_steps": int(self.good_steps),
            "skipped": int(self.skipped),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue a saved dynamic scale (a checkpoint's); a static or absent one is not carried
        over: the configured scale stands."""
        if self.dynamic and state.get("dynamic"):
            self.scale.fill_(float(state["scale"]))
            self.good_steps.fill_(int(state["good_steps"]) % self.growth_interval)
            self.skipped.fill_(float(state["skipped"]))
