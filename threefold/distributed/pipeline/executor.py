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
from dataclasses import dataclass, field

import torch
from torch import nn

from threefold.data.documents import document_layout
from threefold.distributed import comm
from threefold.distributed.comm import Group
from threefold.distributed.pipeline.p2p import WireFormat
from threefold.distributed.pipeline.schedules import Action, group_batches
from threefold.distributed.pipeline.weight_grad import WeightGradStore
from threefold.distributed.timer import DeviceTimer

_SPAN_OF = {"F": "forward", "B": "backward", "W": "weight_grad"}
_UNTIMED = contextlib.nullcontext()


def _untimed(category, label=None):
    return _UNTIMED


class PipelineStats:
    """What one step of the schedule cost this rank. Times are DeviceTimers: host perf_counter on
    CPU; on CUDA event pairs on the stream (the host only launches F/B/W and NCCL's wait() returns
    at once), resolved by one synchronize when a figure is first read after the step."""

    def __init__(self, device: torch.device | str | None = None):
        self.wall = DeviceTimer(device)
        self.recv_wait = DeviceTimer(device)
        self.compute = {kind: DeviceTimer(device) for kind in ("F", "B", "W")}
        self.sent_bytes = 0

    @property
    def wall_s(self) -> float:
        return self.wall.seconds

    @property
    def recv_wait_s(self) -> float:
        return self.recv_wait.seconds

    @property
    def compute_s(self) -> dict[str, float]:
        return {kind: timer.seconds for kind, timer in self.compute.items()}

    @property
    def idle_fraction(self) -> float:
        wall = self.wall_s
        return self.recv_wait_s / wall if wall > 0 else 0.0


@dataclass
class StagePlan:
    """This rank's chunks and where they sit in the pipeline."""

    chunks: list[nn.Module]
    first: list[bool]  # chunk c holds virtual stage 0 (reads tokens)
    last: list[bool]  # chunk c holds the last virtual stage (computes the loss)
    wire: WireFormat
    group: Group
    separator: int | None = None
    """data.document_mask: the end-of-document id every chunk's attention stops at (None = off)."""


class _SentOutput(torch.autograd.Function):
    """A scalar standing in for a stage output that was sent and then freed (Megatron's
    deallocate_output_tensor, without rewriting `.data`): the output's graph stays, its
    [seq, micro-batch, hidden] buffer goes. Backward from the scalar feeds the gradient the next
    stage sent back into that graph. Nothing is saved; the gradient waits on the node itself."""

    @staticmethod
    def forward(ctx, out):
        ctx.incoming = None
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grad, ctx.incoming = ctx.incoming, None
        return grad


def _backward_from_sent(stand_in: torch.Tensor, grad: torch.Tensor) -> None:
    stand_in.grad_fn.incoming = grad
    torch.autograd.backward(stand_in)


@dataclass
class _InFlight:
    """What one step holds between actions, keyed by (micro-batch, chunk)."""

    inputs: dict = field(default_factory=dict)
    """Received activations; their .grad goes back to the previous stage."""
    outputs: dict = field(default_factory=dict)
    """What B runs backward from: the last stage's scaled loss, or an output not freed yet."""
    stand_ins: dict = field(default_factory=dict)
    """The _SentOutput scalar of each output that was sent and freed."""
    grads_from_next: dict = field(default_factory=dict)
    grads_to_prev: dict = field(default_factory=dict)
    held: dict = field(default_factory=dict)
    """A memory meter's token per output this rank still holds (only with a meter)."""
    sends: list = field(default_factory=list)
    """Send requests to wait on at the end of the step (gloo, without free_sent_outputs)."""

    def empty(self) -> bool:
        return not (
            self.inputs or self.outputs or self.stand_ins or self.grads_from_next or self.grads_to_prev or self.held
        )


class PipelineExecutor:
    def __init__(
        self,
        plan: StagePlan,
        actions: list[Action],
        weight_store: WeightGradStore | None = None,
        free_sent_outputs: bool = True,
    ):
        """`free_sent_outputs`: drop each stage output once its send completed, keeping only its
        graph for backward (one [seq, micro-batch, hidden] buffer less per micro-batch in flight)."""
        self.plan, self.steps, self.store = plan, group_batches(actions), weight_store
        self.free_sent_outputs = free_sent_outputs
        if any(a.kind == "W" for a in actions) and weight_store is None:
            raise ValueError("a schedule with W actions needs a WeightGradStore on its linear layers")
        # The action after which a chunk's weight gradients are complete: its last W, else last B.
        last: dict[int, tuple[str, tuple[int, int]]] = {}
        for a in actions:
            if a.kind == "W" or (a.kind == "B" and weight_store is None):
                last[a.chunk] = (a.kind, (a.microbatch, a.chunk))
        self.final_grad_actions = set(last.values())

    def run(
        self,
        microbatches: list[tuple[torch.Tensor, torch.Tensor]],
        loss_divisor: float,
        autocast=contextlib.nullcontext,
        no_sync=None,
        spans=None,
        meter=None,
    ) -> tuple[torch.Tensor, PipelineStats]:
        """Run one step's schedule; returns the summed loss of the micro-batches whose last stage
        is here (zero elsewhere; backward runs on it divided by `loss_divisor`) and this rank's
        timing. `no_sync()`, when given, wraps every gradient-producing action but each chunk's
        last one, so gradient reduction starts only when a chunk's gradients are final (data
        parallelism). `spans`: a span recorder timing each action, or None. `meter`: a
        LiveActivationMeter that also counts the stage outputs this rank holds, or None."""
        plan, state = self.plan, _InFlight()
        span = _untimed if spans is None else spans.span
        device = plan.wire.device
        stats = PipelineStats(device)
        # fp64: the reported loss is a sum over every token of the step, in an order that depends
        # on the layout; in fp32 its last bit (~5e-7 of a per-token loss near 5) would differ.
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        start = stats.wall.start()
        for step in self.steps:
            if isinstance(step, tuple):
                self._exchange(step, state, stats, span)
                continue
            key = (step.microbatch, step.chunk)
            t0 = stats.compute[step.kind].start()
            with span(_SPAN_OF[step.kind], step):
                if step.kind == "F":
                    loss_sum += self._forward(step, key, microbatches, state, loss_divisor, autocast, meter)
                else:
                    final = no_sync is None or (step.kind, key) in self.final_grad_actions
                    with contextlib.nullcontext() if final else no_sync():
                        if step.kind == "B":
                            self._backward(step, key, state)
                        else:
                            self.store.run(key)
            stats.compute[step.kind].stop(t0)
        with span("pp_p2p", "finish sends"):
            for work in state.sends:
                work.wait()
            state.sends.clear()
        stats.wall.stop(start)
        if spans is not None and plan.group.size > 1:  # after wall_s: PipelineStats stay as without spans
            with span("pp_bubble", "pipeline flush"):
                comm.all_reduce(torch.zeros(1, device=device), plan.group)
        if not state.empty() or (self.store and self.store.pending):
            raise RuntimeError("pipeline schedule left work unfinished: a schedule bug")
        return loss_sum, stats

    def _forward(self, action, key, microbatches, state: _InFlight, loss_divisor, autocast, meter) -> torch.Tensor:
        c, plan = action.chunk, self.plan
        tokens, targets = microbatches[action.microbatch]
        x = tokens.to(plan.wire.device, non_blocking=True) if plan.first[c] else state.inputs[key]
        y = targets.to(plan.wire.device, non_blocking=True) if plan.last[c] else None
        if plan.separator is None:
            with autocast():
                out = plan.chunks[c](x, y)
        else:
            # Every stage holds its micro-batches' token ids, so each builds the mask itself
            # (O(batch·seq²) bools, no traffic) instead of receiving it from the first stage.
            docs = document_layout(tokens.to(plan.wire.device, non_blocking=True), plan.separator)
            with autocast():
                out = plan.chunks[c](x, y, documents=docs)
        if plan.last[c]:
            state.outputs[key] = out / loss_divisor
            return out.detach()
        state.outputs[key] = out
        if meter is not None:
            state.held[key] = meter.hold(out)
        return torch.zeros((), device=plan.wire.device)

    def _backward(self, action, key, state: _InFlight) -> None:
        c, plan = action.chunk, self.plan
        grad = None if plan.last[c] else state.grads_from_next.pop(key)
        state.held.pop(key, None)
        with self.store.defer(key) if self.store is not None else contextlib.nullcontext():
            if key in state.stand_ins:
                _backward_from_sent(state.stand_ins.pop(key), grad)
            else:
                torch.autograd.backward(state.outputs.pop(key), grad)
        if not plan.first[c]:
            state.grads_to_prev[key] = state.inputs.pop(key).grad

    def _exchange(self, batch, state: _InFlight, stats: PipelineStats, span=_untimed) -> None:
        with span("pp_p2p", batch):
            works, received = self._post(batch, state, stats)
        t0 = stats.recv_wait.start()
        with span("pp_bubble", batch), comm.peer_timing(self.plan.group, works.recv_peers):
            if len(works) != len(batch) or self.free_sent_outputs:
                # A coalesced batch (NCCL returns one request) lands its receives only when it
                # completes; and a gloo send request holds its buffer - with free_sent_outputs the
                # output - until waited on. Waiting for a batch's sends with its receives is the
                # rule check_schedule proves every schedule deadlock-free under.
                for work in works:
                    work.wait()
            else:  # one request per op (gloo): sends are waited on at the end of the step
                for a, work in zip(batch, works):
                    if a.kind.startswith("RECV"):
                        work.wait()
                    else:
                        state.sends.append(work)
        stats.recv_wait.stop(t0)
        comm.batch_done(works, self.plan.group)  # its receives are in (hang attribution's count)
        for kind, key, tensor in received:
            if kind == "RECV_F":
                state.inputs[key] = tensor.requires_grad_()
            else:
                state.grads_from_next[key] = tensor

    def _post(self, batch, state: _InFlight, stats: PipelineStats):
        """Post one batch of sends and receives; returns (requests, [(kind, key, buffer)] received)."""
        plan, ops, received = self.plan, [], []
        for a in batch:
            key = (a.microbatch, a.chunk)
            if a.kind == "SEND_F":
                tensor = state.outputs[key].detach().contiguous()
                if self.free_sent_outputs:
                    # The send request keeps the buffer alive until the batch waits on it, before the
                    # next compute action; after that only the graph remains. Nothing is saved in
                    # between, so the meter may stop counting the output now.
                    state.stand_ins[key] = _SentOutput.apply(state.outputs.pop(key))
                    state.held.pop(key, None)
            elif a.kind == "SEND_B":
                tensor = state.grads_to_prev.pop(key).contiguous()
            else:
                tensor = plan.wire.empty()
                received.append((a.kind, key, tensor))
            if a.kind.startswith("SEND"):
                stats.sent_bytes += comm.nbytes(tensor)
            ops.append(("send" if a.kind.startswith("SEND") else "recv", tensor, a.peer))
        return comm.batch_send_recv(ops, plan.group), received
