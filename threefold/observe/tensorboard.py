"""TensorBoard scalars mirroring metrics.jsonl (log.tensorboard; the optional `tensorboard` extra).

Every number in a metrics line becomes a scalar at that line's step; nested fields are
flattened into tags ("time_s/mean/forward"). Booleans and text are left out.
"""

from __future__ import annotations

from pathlib import Path

from threefold.errors import ConfigError


def flatten(record: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, tag + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)
    return out


class ScalarBoard:
    """Writes event files into `log_dir` (open it with `tensorboard --logdir log_dir`)."""

    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "log.tensorboard",
                "the tensorboard package is not installed",
                "pip install 'threefold[tensorboard]' or set log.tensorboard false",
            ) from None
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict) -> None:
        step = int(record.get("step", 0))
        for tag, value in flatten(record).items():
            if tag != "step":
                self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
