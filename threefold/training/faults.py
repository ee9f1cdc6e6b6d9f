"""Fault injection for tests and drills: kill, hang or slow a rank, poison a step with NaN,
corrupt a checkpoint file.

A spec is `train.faults` or the environment variable THREEFOLD_FAULT (the variable wins), a
list of faults separated by `,`, each `kind:key=value:key=value`:

    kill:rank=1:step=5         rank 1 dies (SIGKILL) as step 5 begins (first attempt only)
    killnode:rank=1:step=5     rank 1's whole node dies: its elastic agent (the worker's parent)
                               and every worker of that agent (Linux; first attempt only)
    hang:rank=0:step=3         rank 0 stops making progress at step 3 (first attempt only)
    slow:rank=1:factor=3       rank 1's compute takes 3x as long, from step 0 (or :step=S on)
    slowlayer:layer=3:factor=3 the block with global index 3 takes 3x as long, forward and backward,
                               on every rank that holds it (or :rank=R only), from step 0
                               (or :step=S on)
    hotexpert:layer=1:expert=0 MoE layer 1 routes every token to expert 0 first (or :rank=R only)
    nan:step=4                 the loss of step 4 is NaN on every rank (or :rank=R only);
                               :count=N poisons N consecutive steps (once per process)
    corrupt:step=4             after the checkpoint of step 4 is published, flip a byte of its
                               rank00000.pt (or :file=NAME); with :count=N, of the first
                               checkpoint published in steps 4 to 4 + N - 1
    ramloss:rank=1:step=5      rank 1's node loses its memory replicas as step 5 begins (its RAM
                               gone: with kill, a node that came back empty); killnode does too
    enospc:rank=1:step=5       rank 1's write of the checkpoint saved after step 5 fails with
                               ENOSPC, as on a full disk (:count=N: the first save in N steps)
    slow:...:steps=N           (slow only) for N steps from its step, then at full speed again

Steps are 0-based loop indices: `step=5` fires before the sixth optimizer step. A fault that
would recur (kill, killnode, hang, nan, corrupt, ramloss, enospc) fires once per run: the rank
that fires it records it in faults.jsonl with the elastic run's id, and a restarted attempt
(of the same elastic run, whichever its agent) does not fire it again when it replays that step;
outside an elastic agent, once per process and only on a first attempt. The slow kinds (slow,
slowdevice, slowlayer, hotexpert) act on every attempt, as a slow part would.

slowlayer stretches the block itself: module hooks time each forward call and each backward
pass through it and add (factor - 1) x that time before the block returns (_stretch: CPU time
spun on CPU, the device's time slept on CUDA), so whatever times the block from outside sees it
that much slower. hotexpert shifts the MoE layer's input along the expert's router row by
HOT_SHIFT x each token's norm: the router really picks that expert first for every token, the
expert-load table shows it, and the experts compute what they are routed (a drill, not parity).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from threefold.config import TrainConfig
from threefold.distributed.drills import ENV, KINDS, VALID, Fault, check, parse, spec_of  # noqa: F401 - the drill spec
from threefold.errors import ConfigError
from threefold.observe.goodput import read_faults, record_fault

SLOW_KINDS = ("slow", "slowdevice", "slowlayer", "hotexpert")
"""Faults that act on every attempt: a slow part stays slow after a restart."""
ONCE = ("corrupt", "enospc")
"""Faults that act at the first save of their window (:count=N steps from their step), once."""
HOT_SHIFT = 4.0
"""hotexpert: the input shift along the expert's router row, in units of each token's norm (the
row's logit then beats every other row's by far more than the tokens' own spread)."""

# (run, elastic run, fault, step) already fired in this process. A rollback rebuilds the training
# state (and its injector) in the same process; a fault must not fire again on the replayed steps.
# Keyed by the run (its log directory and elastic id): another run in the same process starts afresh.
_FIRED: set[tuple] = set()


class FaultInjector:
    """The faults that concern this rank, fired at the points the training loop reports."""

    def __init__(self, faults: list[Fault], rank: int, restart_count: int, run: str = ""):
        first = restart_count == 0
        self.rank, self.run = rank, run
        self.elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
        # Only the kinds that act on a training step (slowlink acts in the comm layer, stack on
        # the fingerprint: threefold/distributed/drills.py); slow ones on every attempt.
        acting = [f for f in faults if f.kind not in ("slowlink", "stack") and f.rank in (None, rank)]
        self.faults = [f for f in acting if f.kind in SLOW_KINDS or first or self.elastic]
        # What an earlier attempt of this elastic run fired (faults.jsonl): not again.
        self.fired = set()
        if self.elastic and run and any(f.kind not in SLOW_KINDS for f in self.faults):
            self.fired = {
                (e["fault"], e["step"]) for e in read_faults(run) if e.get("run") == self.elastic and "fault" in e
            }
        self.armed = bool(self.faults)
        """Whether any fault concerns this rank: without one a step calls nothing here (RunGuard's
        hooks check this first)."""
        self._poison = False
        self.lose_memory = lambda: None
        """Wipes this node's memory replicas (set by the run's RunGuard): ramloss, killnode."""
        self.step = 0
        """The step under way (step_begins): slowlayer's hooks act from their fault's step on."""

    @classmethod
    def from_config(cls, train: TrainConfig, run: str, rank: int, restart_count: int) -> FaultInjector:
        """The faults of train.faults (or $THREEFOLD_FAULT) for `rank`; `run` (the log directory)
        keys which faults have fired in this process."""
        spec, key = spec_of(train)
        return cls(parse(spec, key), rank, restart_count, run=run)

    def _take(self, kind: str, step: int) -> Fault | None:
        """The fault of `kind` due at `step`, if it has not fired at that step in this process or
        an earlier attempt of the run; recorded in faults.jsonl as it fires (its time first)."""
        for f in self.faults:
            due = f.step <= step < f.step + f.count
            # corrupt and enospc act on the first save in their window [step, step + count), once.
            at = None if kind in ONCE else step
            key = (self.run, self.elastic, f, at)
            fired = (repr(f), step) in self.fired or (at is None and repr(f) in {r for r, _ in self.fired})
            if f.kind == kind and due and key not in _FIRED and not fired:
                _FIRED.add(key)
                if self.run:
                    record_fault(self.run, self.rank, kind, step, run=self.elastic, fault=repr(f))
                return f
        return None

    def install(self, chunks: list[nn.Module]) -> None:
        """NaN faults multiply each chunk's output by NaN: the loss, every downstream
        activation and every gradient become NaN, as a real divergence would make them."""
        if any(f.kind == "nan" for f in self.faults):
            for chunk in chunks:
                chunk.register_forward_hook(lambda _m, _i, out: out * float("nan") if self._poison else None)
        blocks = {int(i): b for chunk in chunks for i, b in getattr(chunk, "layers", {}).items()}
        for f in self.faults:
            if f.kind == "slowlayer" and f.layer in blocks:
                _stretch(blocks[f.layer], f.factor, lambda f=f: self.step >= f.step)
            if f.kind == "hotexpert" and f.layer in blocks:
                _make_hot(blocks[f.layer], f)

    def step_begins(self, step: int, on_fault=lambda fault: None) -> None:
        """Kill or hang this rank, arm the NaN hook, or wipe the node's memory replicas
        (`lose_memory`), as the spec says for `step`. `on_fault` is told first."""
        self.step = step
        self._poison = self._take("nan", step) is not None
        if self._take("ramloss", step) is not None:
            print(f"threefold: fault injection: ramloss on rank {self.rank}'s node at step {step}", file=sys.stderr)
            self.lose_memory()
        for kind in ("kill", "killnode", "hang"):
            fault = self._take(kind, step)
            if fault is None:
                continue
            on_fault(fault)
            print(f"threefold: fault injection: {kind} rank {self.rank} at step {step}", file=sys.stderr, flush=True)
            if kind == "killnode":
                self.lose_memory()  # a lost machine's RAM goes with it
                kill_node()
            if kind in ("kill", "killnode"):
                os.kill(os.getpid(), signal.SIGKILL)
            while True:  # a hang: only the collective timeout of the other ranks ends it
                time.sleep(3600)

    def slow(self, step: int, compute_s: float) -> float:
        """Stretch this step's compute by the slow factor (sleeping); returns the compute time
        the rank now took. Sleeping before the gradient reduction delays the peers too."""
        for f in self.faults:
            if f.kind in ("slow", "slowdevice") and step >= f.step and not (f.steps and step >= f.step + f.steps):
                time.sleep(compute_s * (f.factor - 1.0))
                return compute_s * f.factor
        return compute_s

    def save_error(self, step: int) -> OSError | None:
        """The error the write of the checkpoint saved after `step` meets on this rank (enospc)."""
        if self._take("enospc", step) is None:
            return None
        print(f"threefold: fault injection: ENOSPC on rank {self.rank} at step {step}", file=sys.stderr, flush=True)
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (fault injection)")

    def after_save(self, step: int, directory: Path | None) -> None:
        """Flip one byte in the middle of a file of the published checkpoint of `step` (the
        rank that published it, which alone knows its directory)."""
        if directory is None:
            return
        fault = self._take("corrupt", step)
        if fault is None:
            return
        path = directory / fault.file
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        print(f"threefold: fault injection: corrupted {path}", file=sys.stderr, flush=True)


def _stretch(block: nn.Module, factor: float, due) -> None:
    """Make `block` take `factor` x as long while `due()` (slowlayer): each forward call and
    each backward pass through it spends (factor - 1) x its own measured time more before it
    returns. On CPU, where the device is the host, that is compute: it spins until the process
    has used that much more CPU time (a slower device, not an idle one). On CUDA it synchronizes
    around the block (the device's time) and sleeps with the device idle, which the layer's
    CUDA events see as time inside the block."""
    cuda = any(p.is_cuda for p in block.parameters())

    def now() -> float:
        if cuda:  # the host returns from a launch long before the kernels end
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    opened = {}

    def start(key: str):
        if due():
            opened[key] = now()

    def stop(key: str):
        if key not in opened:
            return
        extra = (factor - 1.0) * (now() - opened.pop(key))
        if cuda:
            time.sleep(extra)
            return
        until = time.process_time() + extra
        while time.process_time() < until:
            pass

    block.register_forward_pre_hook(lambda _m, _a: start("forward"))
    block.register_forward_hook(lambda _m, _a, _o: stop("forward"))
    block.register_full_backward_pre_hook(lambda _m, _g: start("backward"))
    block.register_full_backward_hook(lambda _m, _gi, _go: stop("backward"))


def _make_hot(block: nn.Module, fault: Fault) -> None:
    """Route every token of the block's MoE layer to `fault.expert` first (hotexpert)."""
    from threefold.model.moe import MoE

    moe = getattr(block, "mlp", None)
    if not isinstance(moe, MoE):
        raise ConfigError("train.faults", f"hotexpert: layer {fault.layer} is not an MoE layer", VALID)
    if not 0 <= fault.expert < moe.num_experts:
        raise ConfigError(
            "train.faults", f"hotexpert: expert {fault.expert} of {moe.num_experts}", f"0 to {moe.num_experts - 1}"
        )

    def shift(_module, args):
        x = args[0]
        row = moe.router.weight[fault.expert].detach().to(x.dtype)
        row = row / row.norm().clamp_min(1e-12)
        return (x + HOT_SHIFT * x.detach().norm(dim=-1, keepdim=True) * row, *args[1:])

    moe.register_forward_pre_hook(shift)


def kill_node() -> None:
    """SIGKILL this worker's agent and the agent's other workers (found through /proc):
    the node is gone at once, as when a machine loses power. The killnode drill, and
    train.preflight_exclude's end of an excluded node (training/worker.py)."""
    agent, me = os.getppid(), os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == agent:
                os.kill(int(entry.name), signal.SIGKILL)
    os.kill(agent, signal.SIGKILL)
