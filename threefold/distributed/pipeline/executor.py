"""One executor for every pipeline schedule: it runs a rank's action list, nothing more.

F runs a chunk's forward on a micro-batch (tokens on the first virtual stage, a received
activation elsewhere; the last virtual stage returns the summed loss). B runs its backward
(input and weight gradients; under `zb` the input gradient only, the weight-gradient matmuls
being queued in a WeightGradStore that W then runs). Sends and receives come in batches
(a maximal run of consecutive comm actions): receives are waited for before the next compute
action, sends only at the end of the step, as the schedules' batching convention says.

The time spent waiting for receives is this rank's idle time inside the schedule: the
pipeline bubble plus any transfer time not hidden behind compute.

With a span recorder (threefold.observe.spans) passed to run(), every action is timed on it:
F/B/W as forward/backward/weight_grad (labelled with the action), receive waits as pp_bubble,
posting a batch and finishing the sends as pp_p2p. The step then ends with a pipeline flush (a
one-element all-reduce over the pipeline group), also timed as pp_bubble: the cool-down idle of
the ranks that finish their schedule first, which would otherwise show up in whatever
collective over the pipeline group came next (the gradient norm's).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from threefold.distributed import comm
from threefold.distributed.comm import Group
from threefold.distributed.pipeline.p2p import WireFormat
from threefold.distributed.pipeline.schedules import Action, group_batches
from threefold.distributed.pipeline.weight_grad import WeightGradStore

_SPAN_OF = {"F": "forward", "B": "backward", "W": "weight_grad"}
_UNTIMED = contextlib.nullcontext()


def _untimed(category, label=None):
    return _UNTIMED


@dataclass
class PipelineStats:
    """What one step of the schedule cost this rank."""

    wall_s: float = 0.0
    recv_wait_s: float = 0.0
    compute_s: dict = field(default_factory=lambda: {"F": 0.0, "B": 0.0, "W": 0.0})
    sent_bytes: int = 0

    @property
    def idle_fraction(self) -> float:
        return self.recv_wait_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class StagePlan:
    """This rank's chunks and where they sit in the pipeline."""

    chunks: list[nn.Module]
    first: list[bool]  # chunk c holds virtual stage 0 (reads tokens)
    last: list[bool]  # chunk c holds the last virtual stage (computes the loss)
    wire: WireFormat
    group: Group


class PipelineExecutor:
    def __init__(self, plan: StagePlan, actions: list[Action], weight_store: WeightGradStore | None = None):
        self.plan, self.steps, self.store = plan, group_batches(actions), weight_store
        if any(a.kind == "W" for a in actions) and weight_store is None:
            raise ValueError("a schedule with W actions needs a WeightGradStore on its linear layers")
        # The action after which a chunk's weight gradients are complete: its last W, else last B.
        last: dict[int, tuple[str, tuple[int, int]]] = {}
        for a in actions:
            if a.kind == "W" or (a.kind == "B" and weight_store is None):
                last[a.chunk] = (a.kind, (a.microbatch, a.chunk))
        self.final_grad_actions = set(last.values())

    def run(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]], loss_scale: float,
            autocast=contextlib.nullcontext, no_sync=None, spans=None) -> tuple[torch.Tensor, PipelineStats]:
        """Run one step's schedule; returns the summed (unscaled) loss of the micro-batches
        whose last stage is here (zero elsewhere) and this rank's timing. `no_sync()`, when
        given, wraps every gradient-producing action but each chunk's last one, so gradient
        reduction starts only when a chunk's gradients are final (data parallelism). `spans`:
        a span recorder timing each action, or None."""
        plan, stats = self.plan, PipelineStats()
        span = _untimed if spans is None else spans.span
        device = plan.wire.device
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        grads_from_next: dict[tuple[int, int], torch.Tensor] = {}
        grads_to_prev: dict[tuple[int, int], torch.Tensor] = {}
        pending_sends: list = []
        # fp64: the reported loss is a sum over every token of the step, in an order that depends
        # on the layout; in fp32 its last bit (~5e-7 of a per-token loss near 5) would differ.
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        start = time.perf_counter()
        for step in self.steps:
            if isinstance(step, tuple):
                self._exchange(step, inputs, outputs, grads_from_next, grads_to_prev, pending_sends, stats, span)
                continue
            key = (step.microbatch, step.chunk)
            t0 = time.perf_counter()
            with span(_SPAN_OF[step.kind], step):
                if step.kind == "F":
                    loss_sum += self._forward(step, key, microbatches, inputs, outputs, loss_scale, autocast)
                else:
                    final = no_sync is None or (step.kind, key) in self.final_grad_actions
                    with contextlib.nullcontext() if final else no_sync():
                        if step.kind == "B":
                            self._backward(step, key, inputs, outputs, grads_from_next, grads_to_prev)
                        else:
                            self.store.run(key)
            stats.compute_s[step.kind] += time.perf_counter() - t0
        with span("pp_p2p", "finish sends"):
            for work in pending_sends:
                work.wait()
        stats.wall_s = time.perf_counter() - start
        if spans is not None and plan.group.size > 1:  # after wall_s: PipelineStats stay as without spans
            with span("pp_bubble", "pipeline flush"):
                comm.all_reduce(torch.zeros(1, device=device), plan.group)
        if inputs or outputs or grads_from_next or grads_to_prev or (self.store and self.store.pending):
            raise RuntimeError("pipeline schedule left work unfinished: a schedule bug")
        return loss_sum, stats

    def _forward(self, action, key, microbatches, inputs, outputs, loss_scale, autocast) -> torch.Tensor:
        c, plan = action.chunk, self.plan
        tokens, targets = microbatches[action.microbatch]
        x = tokens.to(plan.wire.device, non_blocking=True) if plan.first[c] else inputs[key]
        with autocast():
            out = plan.chunks[c](x, targets.to(plan.wire.device, non_blocking=True) if plan.last[c] else None)
        if plan.last[c]:
            outputs[key] = out / loss_scale
            return out.detach()
        outputs[key] = out
        return torch.zeros((), device=plan.wire.device)

    def _backward(self, action, key, inputs, outputs, grads_from_next, grads_to_prev) -> None:
        c, plan = action.chunk, self.plan
        out = outputs.pop(key)
        grad = None if plan.last[c] else grads_from_next.pop(key)
        with self.store.defer(key) if self.store is not None else contextlib.nullcontext():
            torch.autograd.backward(out, grad)
        if not plan.first[c]:
            x = inputs.pop(key)
            grads_to_prev[key] = x.grad

    def _exchange(self, batch, inputs, outputs, grads_from_next, grads_to_prev, pending_sends, stats,
                  span=_untimed) -> None:
        with span("pp_p2p", batch):
            works, received = self._post(batch, inputs, outputs, grads_to_prev, stats)
        t0 = time.perf_counter()
        with span("pp_bubble", batch):
            if len(works) == len(batch):  # one request per op (gloo): sends may complete later
                for a, work in zip(batch, works):
                    if a.kind.startswith("RECV"):
                        work.wait()
                    else:
                        pending_sends.append(work)
            else:  # a coalesced batch (NCCL returns one request): its receives land only when it completes
                for work in works:
                    work.wait()
        stats.recv_wait_s += time.perf_counter() - t0
        for kind, key, tensor in received:
            if kind == "RECV_F":
                inputs[key] = tensor.requires_grad_()
            else:
                grads_from_next[key] = tensor

    def _post(self, batch, inputs, outputs, grads_to_prev, stats):
        """Post one batch of sends and receives; returns (requests, [(kind, key, buffer)])."""
        plan, ops, received = self.plan, [], []
        for a in batch:
            key = (a.microbatch, a.chunk)
            if a.kind == "SEND_F":
                tensor = outputs[key].detach().contiguous()
            elif a.kind == "SEND_B":
                tensor = grads_to_prev.pop(key).contiguous()
            else:
                tensor = plan.wire.empty()
                received.append((a.kind, key, tensor))
            if a.kind.startswith("SEND"):
                stats.sent_bytes += comm.nbytes(tensor)
            ops.append(("send" if a.kind.startswith("SEND") else "recv", tensor, a.peer))
        return comm.batch_send_recv(ops, plan.group), received
