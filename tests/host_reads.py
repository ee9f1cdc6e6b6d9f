"""Count the calls that would make the host wait for the device on CUDA, while running on CPU.

On CPU nothing waits, so a sync on the per-step path is invisible to timing. What is visible is
the call itself: a value read to the host (`item`, `tolist`, `cpu`, a tensor's truth or number),
an op whose output size depends on the data (`nonzero`, `bincount`, `unique`, boolean-mask
indexing, `repeat_interleave` without `output_size=`), or a device timer's read. `HostReads`
counts them by name while it is active:

    with HostReads() as reads:
        model(x)
    assert reads.total == 0, reads.calls
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from threefold.distributed.timer import DeviceTimer

_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__float__: "float",
    torch.Tensor.__int__: "int",
    torch.Tensor.__index__: "index",
    torch.Tensor.numpy: "numpy",
    torch.nonzero: "nonzero",
    torch.Tensor.nonzero: "nonzero",
    torch.argwhere: "nonzero",
    torch.bincount: "bincount",
    torch.Tensor.bincount: "bincount",
    torch.unique: "unique",
    torch.Tensor.unique: "unique",
    torch.unique_consecutive: "unique",
    torch.masked_select: "masked_select",
    torch.Tensor.masked_select: "masked_select",
}
_SIZED = {torch.repeat_interleave, torch.Tensor.repeat_interleave}


class HostReads(TorchFunctionMode):
    """Counts, by name, the host reads and data-dependent shapes of the code run inside it."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _READS.get(func)
        if name is not None:
            self.calls[name] += 1
        elif func in _SIZED and kwargs.get("output_size") is None and _repeats_tensor(args, kwargs):
            self.calls["repeat_interleave"] += 1
        elif func is torch.Tensor.__getitem__ and _bool_mask(args[1] if len(args) > 1 else None):
            self.calls["mask_index"] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        self._timer_seconds = DeviceTimer.seconds
        reads = self

        def seconds(timer):  # on CUDA the first read of a timer waits for its last event
            reads.calls["timer"] += 1
            return reads._timer_seconds.fget(timer)

        DeviceTimer.seconds = property(seconds)
        return super().__enter__()

    def __exit__(self, *exc):
        DeviceTimer.seconds = self._timer_seconds
        return super().__exit__(*exc)


def _repeats_tensor(args, kwargs) -> bool:
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else args[0] if args else None)
    return isinstance(repeats, torch.Tensor)


def _bool_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class FakeCudaEvent:
    """torch.cuda.Event stand-in for device timers on CPU: record() stamps a fake device clock
    (advance FakeCudaEvent.clock by hand), synchronize() is counted in FakeCudaEvent.syncs, and
    elapsed_time is in milliseconds, as CUDA's. Reset both class fields before each use."""

    clock = 0.0
    syncs = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = FakeCudaEvent.clock

    def synchronize(self):
        FakeCudaEvent.syncs += 1

    def elapsed_time(self, end) -> float:
        return (end.at - self.at) * 1e3
