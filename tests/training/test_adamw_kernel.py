"""train.adamw: the run's optimizer kernel. `fused` (the default, on every device) runs torch's
fused AdamW kernel, `foreach` the arithmetic of torch.optim.AdamW(foreach=True); both train the
same run to fp32 rounding."""

from __future__ import annotations

from dp_checks import quiet_trainer

STEPS = 4


def _run(data: str, root, **extra) -> tuple[set, list[float]]:
    trainer = quiet_trainer(data, root, STEPS, **extra)
    kernels = {part.optimizer.fused for part in trainer.engine.parts}
    losses = [trainer.train_step(step).loss for step in range(STEPS)]
    return kernels, losses


def test_the_run_updates_with_the_kernel_train_adamw_names(data, tmp_path):
    fused, fused_losses = _run(data, tmp_path / "fused")
    foreach, foreach_losses = _run(data, tmp_path / "foreach", **{"train.adamw": "foreach"})
    assert fused == {True} and foreach == {False}
    assert max(abs(a - b) for a, b in zip(fused_losses, foreach_losses)) <= 1e-5
    assert fused_losses[-1] < fused_losses[0]  # it trains
