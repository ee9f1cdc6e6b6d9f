"""Activation memory of a transformer layer: the formula, and a meter that measures it.

Per-layer bytes that autograd keeps between forward and backward, for this model (Llama block:
RMSNorm, RoPE, GQA, fused SDPA, SwiGLU, no dropout), next to Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models"), whose GPT layer (LayerNorm,
GeLU 4h MLP, dropout, materialized attention, 16-bit) keeps sbh(34 + 5as/h) bytes.
Derivation and the table of what each op saves: docs/tensor_parallel.md.

Symbols: s sequence, b micro-batch, h hidden, a heads, hd = h/a, f ffn_hidden, t tensor-parallel
size, kvl = kv heads held per rank (kv/t, or 1 when kv < t), e bytes per element.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch import nn


def layer_activation_elements(
    s: int,
    b: int,
    h: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    attention: str = "flash",
) -> float:
    """Elements one Llama layer saves for backward, per rank (see the module docstring)."""
    if recompute == "full":
        return s * b * h / (t if sp else 1)  # only the block's input
    hd, kvl = h // heads, (kv_heads // t if kv_heads >= t else 1)
    region = t if sp else 1
    # Two norms, each: its input and the normalized x (sbh), and 1/rms (sb). Replicated in TP,
    # split over the sequence under SP.
    norms = 2 * (2 * s * b * h + s * b) / region
    # The normalized inputs of the column-parallel layers (q/k/v, w1/w3): replicated in TP;
    # under SP the layers keep the sequence shard and all-gather it again in backward.
    column_inputs = 2 * s * b * h / region
    q, out, kv = s * b * h / t, s * b * h / t, 2 * s * b * hd * kvl
    if attention == "flash":
        # Fused kernel: keeps q, k, v, its output and the log-sum-exp (a*s*b); never the s x s
        # scores, so selective recompute leaves it alone (model/recompute.py).
        core = q + kv + out + heads * s * b / t
    elif attention == "math":
        # Unfused: scaled q, k and v expanded to the local heads, the softmax (a s^2 b), output.
        core = q + kv + out if recompute == "selective" else 4 * s * b * h / t + heads * s * s * b / t
    else:
        raise ValueError(f"attention {attention!r} (valid: flash, math)")
    mlp = 4 * s * b * ffn / t  # w1 x, silu(w1 x), w3 x, their product
    return norms + column_inputs + core + mlp


def korthikanti_layer_bytes(
    s: int, b: int, h: int, heads: int, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """The paper's per-layer bytes (Table 2; GPT layer, 16-bit activations, 1-byte dropout masks)."""
    sbh, att = s * b * h, 5 * heads * s / h
    if recompute == "full":
        return 2 * sbh
    if recompute == "selective":
        return 34 * sbh / t if sp else sbh * (10 + 24 / t)
    if sp:
        return sbh / t * (34 + att)
    return sbh * (10 + 24 / t + att / t) if t > 1 else sbh * (34 + att)


class SavedTensorMeter:
    """Counts the bytes of tensors autograd saves during a forward, each storage once,
    attributed to the module scope (e.g. "layer3") that saved it first. Parameters and other
    storages listed in `exclude` are not activations and are skipped.

        meter = SavedTensorMeter(model)
        with meter:
            loss = model(tokens, targets)
        meter.by_scope  # {"layer0": bytes, ..., "other": bytes}
    """

    def __init__(self, model: nn.Module, exclude: list[torch.Tensor] = ()):
        self.by_scope: dict[str, int] = defaultdict(int)
        self._seen: set[int] = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen |= {t.untyped_storage().data_ptr() for t in exclude}
        self._scope, self._handles = "other", []
        for name, block in getattr(model, "layers", {}).items():
            self._handles.append(block.register_forward_pre_hook(self._enter(f"layer{name}")))
            self._handles.append(block.register_forward_hook(self._leave))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._stack = contextlib.ExitStack()

    def _enter(self, scope: str):
        def hook(module, args):
            self._scope = scope

        return hook

    def _leave(self, module, args, output):
        self._scope = "other"

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen:
            self._seen.add(key)
            self.by_scope[self._scope] += storage.nbytes()
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._stack.enter_context(self._hooks)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        for handle in self._handles:
            handle.remove()

    def per_layer(self) -> float:
        layers = [v for k, v in self.by_scope.items() if k.startswith("layer")]
        return sum(layers) / max(1, len(layers))


class _Held:
    """What the autograd graph keeps for one saved tensor; its death frees the bytes."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: LiveActivationMeter, key: int):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class LiveActivationMeter:
    """Peak bytes of activations held for backward at any moment (each storage once), over
    everything run inside the block: forwards and backwards of many micro-batches, e.g. a whole
    pipeline schedule. Parameters are not counted.

        with LiveActivationMeter(model) as meter:
            run_schedule()
        meter.peak_bytes
    """

    def __init__(self, model: nn.Module):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self.live_bytes = self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            self._pack, lambda held: held.tensor if isinstance(held, _Held) else held
        )

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self._params:
            return t
        if key not in self._refs:
            self._refs[key], self._bytes[key] = 0, t.untyped_storage().nbytes()
            self.live_bytes += self._bytes[key]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] += 1
        return _Held(t, self, key)

    def hold(self, t: torch.Tensor) -> _Held:
        """Count `t` as held for backward by someone other than autograd (a pipeline stage's
        output waiting for its gradient) until the returned token is dropped."""
        return self._pack(t)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live_bytes -= self._bytes.pop(key)

    def __enter__(self) -> LiveActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
