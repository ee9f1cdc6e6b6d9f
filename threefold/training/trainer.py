"""The trainer of one worker: everything a run needs, built once, and a step you can call.

    trainer = Trainer(cfg, grid, device)   # stage, engine, data, resume, records, guard, spans
    result = trainer.train_step(step)      # one optimizer step -> observe.step.StepResult
    last = trainer.train()                 # the loop (training/loop.py): steps, evaluation, checkpoints, rollback

A step is a short list of phases, each timed as its span category when log.spans is on:

    data_wait         this rank's micro-batches (the prefetcher, or the sampler)
    forward/backward  the pipeline schedule over them: every F, B, W and transfer is its own span
    finalize_grads    every reduction after backward and the global norm (distributed/finalize.py)
    optimizer         one MAX all-reduce (any rank's NaN/Inf makes every rank skip, decided on the
                      device; the slowest rank's memory, data wait, pipeline wait, compute), clip
                      and AdamW (ZeRO 1/2 gather the new parameters)
    sync              the loss (one SUM all-reduce), and the step's one host read
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from threefold.checkpoint import choose, load_into, training_state
from threefold.checkpoint.manifest import step_dir_name
from threefold.checkpoint.replicas import MemoryReplicas
from threefold.config import Config
from threefold.data import GlobalBatchSampler, load_tokens
from threefold.data.split import training_part
from threefold.data.tokenizer import check_vocab, open_tokenizer
from threefold.distributed import failures
from threefold.distributed.comm import all_reduce_max
from threefold.distributed.context_parallel.apply import split_microbatches
from threefold.distributed.data_parallel import MixedPrecision, build_data_parallel
from threefold.distributed.data_parallel.state import refresh_params
from threefold.distributed.finalize import finalize_grads
from threefold.distributed.grid import Grid
from threefold.distributed.parallelize import build_model
from threefold.distributed.pipeline import bubble_theory
from threefold.distributed.pipeline.stage import build_stage, tied_head_weights
from threefold.distributed.runtime import WorkerEnv, startup_done
from threefold.errors import DataError
from threefold.inference.evaluate import HeldOutEval
from threefold.model.flops import train_flops_per_token
from threefold.model.sharding import partial_params
from threefold.observe import device_peak_flops, peak_memory_bytes, write_run_json
from threefold.observe.diagnose import Diagnosis
from threefold.observe.goodput import process_start_time
from threefold.observe.layers import LayerClock
from threefold.observe.metrics import MetricsWriter
from threefold.observe.observer import StepObserver
from threefold.observe.prometheus import Exporter
from threefold.observe.step import QueuedStep, StepResult, Throughput
from threefold.training.actions import Actions
from threefold.training.callbacks import Callbacks
from threefold.training.expert_load import ExpertLoad
from threefold.training.health import skip_nonfinite
from threefold.training.loop import TrainingLoop
from threefold.training.optim import lr_at
from threefold.training.resilience import RunGuard, continues_run
from threefold.training.seating import restart_line
from threefold.training.signals import Stopped, StopSignals, completion_event
from threefold.training.status import StatusLine

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Parameter and activation dtype; bf16/fp16 keep fp32 master weights in the optimizer."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def open_data(cfg: Config):
    """Token stream + sampler; refuses a corpus whose ids do not fit the model's vocabulary."""
    d, m = cfg.data, cfg.model
    tokens = load_tokens(d.path, d.vocab, d.dtype, d.cache_dir, d.tokenizer)
    if tokens.vocab_size > m.vocab:
        raise DataError(
            f"{tokens.source}: token ids go up to vocab {tokens.vocab_size} but model.vocab is "
            f"{m.vocab} (set --model.vocab {tokens.vocab_size} or larger)"
        )
    if d.tokenizer:
        check_vocab(open_tokenizer(d.tokenizer), m.vocab, f"data.tokenizer {d.tokenizer}")
    tokens = training_part(tokens, d.val_fraction)  # the held-out tail is never sampled
    sampler = GlobalBatchSampler(len(tokens.tokens), m.seq_len, cfg.train.global_batch, cfg.train.seed)
    return tokens, sampler


def _quiet(*_args) -> None:
    pass


@dataclass(frozen=True)
class ScheduleFigures:
    """A step's schedule timers, read to host floats: what a later step's agreement carries
    (the compute time stragglers are judged by, the pipeline receive waits)."""

    compute_s: dict[str, float]
    recv_wait_s: float
    idle_fraction: float

    @classmethod
    def of(cls, pipe) -> ScheduleFigures:
        """Reads `pipe`'s timers (the executor's PipelineStats): on CUDA a wait for the device."""
        return cls(pipe.compute_s, pipe.recv_wait_s, pipe.idle_fraction)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        grid: Grid,
        device: torch.device,
        log=print,
        probe=None,
        restarted: bool = False,
        stop: StopSignals | None = None,
        callbacks: Callbacks | None = None,
        fingerprint: dict | None = None,
        preflight_s: float = 0.0,
    ):
        """Build this rank's part of the run and load a checkpoint when checkpoint.resume (or
        init_from) says so; `restarted` (a worker the elastic agent restarted) continues from
        its memory replicas (checkpoint.memory_interval) or the newest checkpoint in
        checkpoint.dir, if there is one yet. `preflight_s`: how long the worker's pre-flight took.
        `probe` (threefold memory's MemoryProbe) watches each step's activations and measures the model state after the
        optimizer step. `stop` (training/signals.py): the signals this rank listens to; every rank
        stops after the first step whose read shows one, saves, and raises Stopped. `callbacks`:
        a library user's hooks (training/callbacks.py). `fingerprint`: this rank's stack
        (preflight/fingerprint.py), written into run.json and every checkpoint's manifest; a
        resume from a checkpoint of another stack says what changed."""
        self.callbacks = callbacks or Callbacks()
        m, t, p = cfg.model, cfg.train, cfg.parallel
        self.cfg, self.grid, self.device, self.probe, self.stop = cfg, grid, device, probe, stop
        self.fingerprint = fingerprint
        self.is_logger = grid.global_rank == 0
        self.log = log if self.is_logger else _quiet
        self.dtype = resolve_dtype(t.dtype, device)
        self.chunks, self.executor = build_stage(cfg, grid, device, partial(build_model, cfg, grid, device), self.dtype)
        self.model = nn.ModuleList(self.chunks)  # this rank's pipeline chunks (one without pipelining)
        tied = m.tie_embeddings
        self.tied = tied_head_weights(self.chunks, tied, grid)  # the embedding and its last-stage copy
        self.tied_copy = [w for c in self.chunks if c.tok_embed is None for w in tied_head_weights([c], tied, grid)]
        precision = MixedPrecision.from_names(
            DTYPE_NAMES[self.dtype], t.grad_reduce_dtype, t.loss_scale, t.initial_loss_scale, t.loss_scale_window
        )
        self.engine = build_data_parallel(
            self.chunks,
            grid,
            zero=p.zero,
            bucket_mb=p.bucket_mb,
            overlap_param_gather=p.overlap_param_gather,
            zero3_prefetch=p.zero3_prefetch,
            precision=precision,
            betas=(t.beta1, t.beta2),
            weight_decay=t.weight_decay,
            own_bucket=self.tied,
            fused_adamw=t.adamw == "fused",
        )
        self.expert_load = ExpertLoad.of(self.chunks, m, t.global_batch // t.micro_batch, device)
        self.partial = partial_params(self.chunks)  # gradients each TP rank holds a part of
        if self.executor.store is not None:  # zero-bubble W passes add their dW through the engine
            self.executor.store.accumulate = self.engine.accumulate_grad
        self.state = training_state(
            self.chunks, self.engine, grid, aliases={id(w): "tok_embed.weight" for w in self.tied_copy}
        )
        self.tokens, self.sampler = open_data(cfg)
        self.tokens_per_step = t.global_batch * m.seq_len
        flops_per_step = train_flops_per_token(m, m.seq_len) * self.tokens_per_step
        peak = device_peak_flops(
            device, self.dtype, threads=t.threads if device.type == "cpu" else None, cache_dir=cfg.data.cache_dir
        )
        bubble = bubble_theory(p.schedule, p.pp, p.microbatches, p.vpp) if p.pp > 1 else 0.0
        self.throughput = Throughput(self.tokens_per_step, flops_per_step, grid.layout.world_size, peak, bubble)
        self.observer = StepObserver(cfg.log, grid, device, self.is_logger)  # where each rank's step time went
        self.observer.attach(self.chunks, self.engine)
        self.layers = LayerClock(self.chunks, cfg, grid, device, self.is_logger)  # per-layer time, traced steps
        self.diagnosis = Diagnosis(cfg, grid, self.is_logger, self.log)  # what the spans show drags
        self.actions = Actions(cfg, grid, self.is_logger, self.log)  # train.on_slow
        self.exporter = Exporter(cfg, grid, self.is_logger)  # log.prometheus_port
        self.replicas = MemoryReplicas.build(cfg, grid, self.state, device, WorkerEnv.from_environ())
        self.attempt_start = {"process_start": process_start_time(), "preflight_s": preflight_s}
        self.start_step = self.resume(restarted)
        self.metrics = self.guard = None
        self._open_records()
        if self.is_logger:
            write_run_json(
                cfg.log.dir,
                cfg.to_dict(),
                grid.describe(),
                device=device,
                fingerprint=fingerprint,
                extra={
                    "data": self.tokens.source,
                    "peak_flops_per_device": peak,
                    "dtype": str(self.dtype),
                    "train_flops_per_token": flops_per_step / self.tokens_per_step,
                },
            )
        self.status = StatusLine(t.steps, cfg.log.interval, enabled=self.is_logger and not cfg.log.quiet)
        self.heldout = HeldOutEval(cfg) if t.eval_every else None
        self._schedule_read: ScheduleFigures | None = None  # those of the newest step read
        # On CUDA a step's scalars are read after the next step is queued (1); on CPU there is
        # nothing to overlap with the host, so each step is read at once (0).
        self.read_lag = int(device.type == "cuda")

    # --- loading ------------------------------------------------------------------------------
    def resume(self, restarted: bool = False) -> int:
        """Load what checkpoint.resume names (a checkpoint of any layout) into this rank's slices, or
        init_from's model weights; returns the step to continue from (data order and LR schedule
        are functions of the step). Collective: rank 0 picks the checkpoint and every rank loads
        that one, having verified the files it reads (checkpoint/resume.py)."""
        c, world = self.cfg.checkpoint, self.grid.world
        step, found, memory = 0, None, False
        self.attempt_start["load_start"] = time.time()
        if world.size > 1 and os.environ.get("TORCHELASTIC_RUN_ID"):
            # Agents of several nodes may count restarts differently (a node's agent restarts its
            # workers for the membership change, not for a failure): every rank resumes if any does.
            flag = torch.tensor([int(restarted)], dtype=torch.int64, device=world.device)
            restarted = bool(all_reduce_max(flag, world).item())
        if self.replicas is not None:  # every rank: a replacement node's too (not restarted itself)
            found = self.replicas.restore(self.state, c.resume == "auto" or restarted, c.dir, warn=self.log)
            memory, restarted = found is not None, restarted or self.replicas.wanted_anywhere
        if found is None and c.dir and (c.resume == "auto" or restarted):
            found = choose(self.state, world, root=c.dir, warn=self.log)
            if found is None and c.resume in ("", "auto") and not restarted:
                self.log(f"threefold: no checkpoint in {c.dir} yet: starting at step 0")
        if found is None and c.resume not in ("", "auto"):
            found = choose(self.state, world, path=c.resume, warn=self.log)
        if found is not None:
            step = self.load(*found, quiet=restarted or memory)
        self.attempt_start.update(load_end=time.time(), source="memory" if memory else "storage" if found else "none")
        if memory and not restarted:
            self.log(f"threefold: resumed at step {step} from memory replicas")
        if restarted:  # the failure and the recovery, in one line (distributed/failures.py)
            # The agent's own limit (torchrun --max-restarts may differ from train.max_restarts).
            of = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", self.cfg.train.max_restarts))
            n = WorkerEnv.from_environ().restart_count
            why = failures.summary(self.cfg.log.dir, n - 1, world.size) if self.is_logger else None
            source = f" from {found[0].name}" if found is not None else " (no checkpoint yet)"
            if memory:
                source = f" from memory replicas ({step_dir_name(step)})"
            self.log(restart_line(n, of, why, step, source))  # with what the round changed (seating.py)
        if step == 0 and c.init_from:
            weights = [s for s in self.state if s.name.startswith("model/")]
            directory, manifest = choose(weights, world, path=c.init_from, warn=self.log)
            # Fine-tuning: the weights only, into the fp32 masters; moments, step and data start anew.
            load_into(weights, directory, manifest)
            refresh_params(self.engine, 0)
            self.log(f"threefold: model weights from {directory} (step {manifest.step}); training starts at step 0")
        return step

    def load(self, directory: Path, manifest, quiet: bool = False) -> int:
        """Every tensor of a checkpoint `choose` picked into this rank's slices, the working weights
        from the loaded masters, and a dynamic loss scale; returns the checkpoint's step."""
        self.engine.wait_params()  # a rollback: the last step's parameter gathers write the buffer
        load_into(self.state, directory, manifest)
        self._say_stack_change(directory, manifest.extra.get("fingerprint"))
        refresh_params(self.engine, manifest.extra["optimizer_step"])
        self.engine.scaler.load_state_dict(manifest.extra.get("loss_scaler", {}))
        if not quiet:
            self.log(f"threefold: resumed from {directory} at step {manifest.step}")
        return manifest.step

    def _say_stack_change(self, directory: Path, saved: dict | None) -> None:
        """One line when the checkpoint was written on another stack (older checkpoints carry
        no fingerprint: nothing to compare)."""
        if saved is None or self.fingerprint is None:
            return
        from threefold.preflight.stack import describe_change

        change = describe_change(saved, self.fingerprint)
        if change:
            self.log(f"threefold: resuming {directory.name}: {change}")

    def reload(self, at_most: int) -> bool:
        """A rollback: the newest checkpoint of checkpoint.dir saved no later than step `at_most`
        (rank 0's choice, on every rank), and the records of a new attempt from its step; False
        when none is there or verifies."""
        c = self.cfg.checkpoint
        started = time.time()
        found = choose(self.state, self.grid.world, root=c.dir, warn=self.log, at_most=at_most)
        if found is None:
            return False
        self.start_step = self.load(*found)
        self.attempt_start = {"load_start": started, "load_end": time.time(), "source": "storage"}
        self._open_records(faults=self.guard.faults)
        return True

    def _open_records(self, faults=None) -> None:
        """metrics.jsonl (appended to when the run continues) and the guard of this attempt."""
        cfg, log = self.cfg, self.log
        self.metrics = MetricsWriter(
            cfg.log.dir, enabled=self.is_logger, append=continues_run(self.start_step), tensorboard=cfg.log.tensorboard
        )
        self.guard = RunGuard(
            cfg,
            self.grid,
            self.chunks,
            self.state,
            self.start_step,
            log,
            self.engine.scaler,
            faults=faults,
            on_saved=self.callbacks.checkpoint,
            fingerprint=self.fingerprint,
            replicas=self.replicas,
            attempt_start=self.attempt_start,
            updates=lambda: self.engine.parts[0].optimizer.step_count,
        )
        self.actions.next_save = self.guard.cadence.next_storage_save  # checkpoint.interval auto

    # --- the run ------------------------------------------------------------------------------
    def train(self) -> dict:
        """Steps start_step .. train.steps (training/loop.py); returns the last step's metrics
        record, or with a memory probe every rank's memory rows on rank 0."""
        try:
            last = TrainingLoop(self).run()
        except Stopped:  # saved to storage: a later run resumes there, not from these copies
            if self.replicas is not None:
                self.replicas.finish()
            raise
        if self.replicas is not None:
            if self.probe:
                self.probe.replica = self.replicas.measure(last["step"])
            self.replicas.finish()
        if self.probe:
            return self.probe.gather(self.cfg, self.grid, self.chunks, self.dtype)
        c = self.cfg.checkpoint
        saved = Path(c.dir) / step_dir_name(last["step"]) if c.dir and last else None
        builtin = ":" not in self.cfg.model.arch  # threefold generate serves the built-in architectures
        if self.is_logger and saved is not None and saved.is_dir() and builtin:
            self.log(
                f"threefold: saved {saved}; sample from it: threefold generate --checkpoint {saved} --prompt 'def '"
            )
        return last

    # --- one step -----------------------------------------------------------------------------
    def batches(self, step: int) -> list:
        """This rank's micro-batches of global step `step` (0-based)."""
        t = self.cfg.train
        # The cp ranks of one dp index read the same samples and keep their zigzag columns.
        batches = self.sampler.microbatches(
            self.tokens.tokens, step, self.grid.dp_rank, self.grid.layout.dp, t.micro_batch
        )
        return split_microbatches(batches, self.grid)

    def train_step(self, step: int, batches: list | None = None, data_wait_s: float = 0.0) -> StepResult:
        """One optimizer step on global step `step` (0-based): `batches` (default: the
        sampler's) through the schedule, gradients finalized, agreed on, applied, and its scalars
        read. Collective over the world; every rank returns the same values but step_time_s and
        tp_comm_bytes."""
        return self.read_step(self.queue_step(step, batches, data_wait_s))

    def queue_step(self, step: int, batches: list | None = None, data_wait_s: float = 0.0) -> QueuedStep:
        """train_step up to its host read: on CUDA every kernel and collective of the step is
        queued and the host may go on (the next step's micro-batches, its forward) before
        read_step waits for the scalars."""
        t, grid, engine, phase = self.cfg.train, self.grid, self.engine, self.observer.phase
        # The step began when it started waiting for its batches (the loop's prefetcher), so
        # step_time_s, tokens/s and MFU count a data-starved step's wait, as a wall clock would.
        t0 = time.perf_counter() - data_wait_s
        tp_bytes0 = grid.tp.stats.total_bytes
        if batches is None:
            with phase("data_wait"):
                batches = self.batches(step)
        lr = lr_at(step, t)
        # Under loss scaling the scale is a tensor on the device (decided there): never read here.
        scale = engine.scaler.scale if engine.scaler.enabled else 1.0
        self.expert_load.set_loss_weight(scale)
        # Every micro-batch through this rank's stage, in schedule order. parallel.grad_reduce:
        # overlap runs each chunk's last backward outside no_sync, so its buckets reduce over dp
        # while backward goes on; after holds every reduction for finalize; every reduces each
        # micro-batch's gradients as they come (ZeRO 2/3).
        mode = self.cfg.parallel.grad_reduce
        if mode == "every" and engine.zero < 2:  # dp 1 runs ZeRO as stage 0: nothing to reduce
            mode = "overlap"
        with (
            self.probe.watch(self.chunks) if self.probe else contextlib.nullcontext() as meter,
            engine.no_sync() if mode == "after" else contextlib.nullcontext(),
        ):
            # Backward runs on the loss over the step's tokens, times a dynamic loss scale (fp16).
            loss_sum, pipe = self.executor.run(
                batches,
                self.tokens_per_step / scale,
                no_sync=engine.no_sync if mode == "overlap" else None,
                spans=self.observer.recorder,
                meter=meter,
            )
        # The schedule's figures: this step's on CPU (host clocks) when each step is read at once;
        # on CUDA, or with reads one step late, those of the newest step read: reading this
        # step's events, or the previous step's before its read, would make the host wait for
        # the device before the update is queued.
        live = self.device.type != "cuda" and not self.read_lag
        timed = ScheduleFigures.of(pipe) if live else self._schedule_read
        compute_s = self.guard.compute_time(step, timed) if timed is not None else 0.0
        # The loss over the world rides the norm's sums over dp and the stages: only the last
        # stage computed one, and each rank's sums run over its own tp coordinate (every TP
        # rank holds the same loss), so each replica's loss is counted once.
        world_loss = loss_sum.reshape(1).clone()
        norm = finalize_grads(engine, grid, self.partial, self.tied, self.tied_copy, phase, carry=world_loss)
        with phase("optimizer"):
            # Any rank's NaN makes every rank skip, decided on the device from the global norm
            # and loss (a NaN norm), so the update is queued without waiting for the host.
            norm = skip_nonfinite(norm, world_loss)
            applied = engine.step(lr, norm, t.grad_clip)
            if self.probe:
                self.probe.after_step(engine)
            engine.zero_grad()
        with phase("sync"):
            # The step's agreement after its update (counters, the slowest rank's figures, a
            # stop): its blocking MAX is the step's last, so the ranks start the next one together.
            waits = (timed.recv_wait_s, timed.idle_fraction) if timed is not None else (0.0, 0.0)
            worst = (float(peak_memory_bytes(self.device)), data_wait_s, *waits)
            self.guard.agree(norm, loss_sum, compute_s, engine, worst, self.stop.requested if self.stop else 0)
            if self.stop is not None:
                self.stop.settled(completion_event(self.device))  # on CUDA the all-reduce is only queued
            # Every scalar of the step in one tensor.
            applied_t = torch.as_tensor(applied, dtype=torch.float64, device=self.device).reshape(1)
            scale_t = engine.scaler.scale.double().reshape(1)  # after this step's update of the scale
            scalars = [world_loss, norm.double().reshape(1), applied_t, scale_t]
            scalars.append(self.guard.take_pending())
            if step == self.start_step:  # start-up's long deadline ends with the first step (distributed/runtime.py)
                startup_done(grid)
        timers: dict[str, list] = {}  # handed over unread: read_step reads them
        for part in engine.parts:  # MoE: the dense and the expert engine
            for name, timer in part.step_timers().items():
                timers.setdefault(name, []).append(timer)
        return QueuedStep(step, lr, t0, torch.cat(scalars), grid.tp.stats.total_bytes - tp_bytes0, timers, pipe)

    def read_step(self, queued: QueuedStep, since: float | None = None) -> StepResult:
        """The step's one host read, and what the step did. `since`: when the previous step's
        read ended, if that was after this step began (read late): the step's time runs from
        there, so consecutive steps' times add up to the host's wall time and none overlap."""
        with self.observer.phase("sync"):
            values = queued.scalars.tolist()
        # The device is past the step now: its timers are read without waiting for it.
        comm = {name: sum(t.seconds for t in timers) for name, timers in queued.timers.items()}
        self._schedule_read = ScheduleFigures.of(queued.schedule)
        worst = self.guard.settle(values[4:])
        now = time.perf_counter()
        return StepResult(
            queued.step + 1,
            values[0] / self.tokens_per_step,
            values[1],
            queued.lr,
            bool(values[2]),
            now - max(queued.started, since or 0.0),
            worst["data_wait_s"],
            int(worst["peak_mem_bytes"]),
            worst["pp_idle_s"],
            worst["pp_idle_fraction"],
            queued.tp_comm_bytes,
            comm.pop("dp_exposed_s"),
            values[3],
            extra=comm,  # ZeRO 1/2: param_gather_wait_s; ZeRO 3: zero3_gather_wait_s
        )
