"""Per-rank model-state memory: measured from the live tensors, and predicted by ZeRO's formulas.

ZeRO paper, section 3 (Psi = P parameters, N = dp degree, K = 12 optimizer bytes/parameter
for mixed-precision Adam: fp32 master + two fp32 moments):

    stage 0: 2P + 2P + 12P     = 16P         fp32 training: 4P + 4P + 8P     = 16P
    stage 1: 2P + 2P + 12P/N   = 4P + 12P/N                 4P + 4P + 8P/N
    stage 2: 2P + (2P + 12P)/N = 2P + 14P/N                 4P + (4P + 8P)/N
    stage 3: (2P + 2P + 12P)/N = 16P/N                      16P/N

(params + grads + optimizer state), the paper's 16-bit gradients. threefold's default under
bf16/fp16 (train.grad_reduce_dtype auto) keeps fp32 gradients, as Megatron does: the gradient
term is 4P instead of 2P (stage 0 18P, stage 1 6P + 12P/N, stage 2 2P + 16P/N, stage 3 18P/N);
grad_reduce_dtype bf16 gives the table above. In fp32 training the master weights are the
parameters themselves, so optimizer state is 8 bytes (two moments). `predict_memory` covers all of these;
it needs only numbers, so `threefold memory` can call it without building a model.

Measurement counts each storage once (parameters are views of flat buffers, fp32 master
weights may be those same buffers), assigned to the first category that holds it, in the
order parameters, gradients, optimizer state. Read it after `step()` and before `zero_grad()`,
the point the formulas describe (ZeRO 2/3 drop their gradient shard at zero_grad, as torch's
set_to_none does). ZeRO 2/3's full-size gradient buckets and ZeRO 3's gathered units are
transient and gone by then; their peak shows in the device's peak memory instead, and ZeRO 3's
parameters at their peak are counted on their own (`zero3_param_peak`): the shard plus the
units whole or being gathered at the worst moment of the step, against shard + root +
(zero3_prefetch + 1) blocks, the bound the in-flight limit keeps (params.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CATEGORIES = ("params", "grads", "optimizer")


@dataclass
class MemoryReport:
    numel: int  # P: parameters on this rank before dp sharding
    dp: int
    zero: int
    measured: dict[str, int]
    predicted: dict[str, float]
    formula: str

    @property
    def measured_total(self) -> int:
        return sum(self.measured.values())

    @property
    def predicted_total(self) -> float:
        return sum(self.predicted[c] for c in CATEGORIES)

    def ratio(self) -> float:
        """measured / predicted, for all three together."""
        return self.measured_total / self.predicted_total

    def table(self) -> str:
        lines = [
            f"P = {self.numel:,} parameters, dp N = {self.dp}, zero {self.zero}: {self.formula}",
            f"{'':10} {'measured':>14} {'predicted':>14}",
        ]
        for c in CATEGORIES:
            lines.append(f"{c:10} {self.measured[c]:>14,} {self.predicted[c]:>14,.0f}")
        lines.append(f"{'total':10} {self.measured_total:>14,} {self.predicted_total:>14,.0f}")
        return "\n".join(lines)


def predict_memory(
    numel: int, dp: int, zero: int, param_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype | None = None
) -> dict:
    """Bytes per rank of params, grads, optimizer state (and the formula) for ZeRO `zero`."""
    kp = torch.empty((), dtype=param_dtype).element_size()
    kg = torch.empty((), dtype=grad_dtype or param_dtype).element_size()
    ko = 8 if param_dtype == torch.float32 else 12  # (+4 for a separate fp32 master)
    n = max(1, dp)
    split = {"params": zero >= 3, "grads": zero >= 2, "optimizer": zero >= 1}
    per = {"params": kp, "grads": kg, "optimizer": ko}
    out = {c: per[c] * numel / (n if split[c] and zero > 0 else 1) for c in CATEGORIES}
    out["formula"] = " + ".join(f"{per[c]}P" + ("/N" if split[c] and zero > 0 else "") for c in CATEGORIES)
    return out


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def measure_memory(engine) -> MemoryReport:
    """Bytes this rank holds for `engine`'s model state, deduplicated by storage."""
    seen: set[int] = set()
    measured = dict.fromkeys(CATEGORIES, 0)

    def count(category: str, tensors) -> None:
        for t in tensors:
            if t is None:
                continue
            ptr, nbytes = _storage_key(t)
            if nbytes == 0 or ptr in seen:
                continue
            seen.add(ptr)
            measured[category] += nbytes

    store, grads = engine.store, engine.grads
    count("params", [p.detach() for p in engine.params])
    count("params", [getattr(store, "flat", None), getattr(store, "shard", None)])
    count("grads", [p.grad for p in engine.params])
    count("grads", [grads.flat, grads.shard, *grads.full])
    count("optimizer", engine.optimizer.tensors().values())
    numel = sum(s.numel for s in engine.layout.slots)
    pred = predict_memory(
        numel, engine.group.size, engine.zero, engine.precision.param_dtype, engine.precision.grad_dtype
    )
    formula = pred.pop("formula")
    return MemoryReport(numel, engine.group.size, engine.zero, measured, pred, formula)


def zero3_param_peak(engine) -> dict | None:
    """ZeRO 3 over dp > 1: this rank's parameter bytes at their peak since the last call, measured
    (the shard + the most bytes of units whole or being gathered at once, params.py's
    `take_peak_held`) and predicted (shard + root units + (prefetch + 1) x the largest block);
    None otherwise."""
    store = engine.store
    if engine.zero != 3 or not hasattr(store, "take_peak_held"):
        return None
    elem = store.shard.element_size()
    shard = store.shard.numel() * elem
    buckets = engine.layout.buckets
    root = sum(b.numel for b in buckets if b.index not in store.blocks) * elem
    block = max((b.numel for b in buckets if b.index in store.blocks), default=0) * elem
    held = min(len(store.blocks), store.depth + 1)
    return {
        "measured": shard + store.take_peak_held(),
        "predicted": shard + root + held * block,
        "formula": f"shard + root + {held} x block",
    }
