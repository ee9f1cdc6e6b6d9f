"""The training loop of one worker: data -> forward/backward over micro-batches -> gradient
sync -> clip -> AdamW -> metrics."""
from __future__ import annotations

import contextlib
import time
from functools import partial

import torch
from torch import nn

from threefold.checkpoint import find_resumable, load_into, open_checkpoint, training_state
from threefold.data import GlobalBatchSampler, Prefetcher, load_tokens
from threefold.data.split import training_part
from threefold.data.tokenizer import check_vocab, open_tokenizer
from threefold.distributed.comm import all_reduce_max, all_reduce_sum
from threefold.distributed.data_parallel import MixedPrecision, build_data_parallel
from threefold.distributed.data_parallel.state import refresh_params
from threefold.distributed.grid import Grid
from threefold.distributed.parallelize import build_model
from threefold.distributed.pipeline import bubble_theory
from threefold.distributed.pipeline.stage import build_stage, tied_head_weights
from threefold.distributed.tensor_parallel import partial_grad_params
from threefold.errors import DataError
from threefold.inference.evaluate import HeldOut
from threefold.observe import (MetricsWriter, device_peak_flops, mfu, peak_memory_bytes, train_flops_per_token,
                               write_run_json)
from threefold.observe.observer import StepObserver
from threefold.train.expert_load import ExpertLoad
from threefold.train.optim import lr_at
from threefold.train.resilience import RunGuard, continues_run
from threefold.train.status import StatusLine


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Parameter and activation dtype; bf16/fp16 keep fp32 master weights in the optimizer."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def open_data(cfg):
    """Token stream + sampler; refuses a corpus whose ids do not fit the model's vocabulary."""
    d, m = cfg.data, cfg.model
    tokens = load_tokens(d.path, d.vocab, d.dtype, d.cache_dir, d.tokenizer)
    if tokens.vocab_size > m.vocab:
        raise DataError(f"{tokens.source}: token ids go up to vocab {tokens.vocab_size} but model.vocab is "
                        f"{m.vocab} (set --model.vocab {tokens.vocab_size} or larger)")
    if d.tokenizer:
        check_vocab(open_tokenizer(d.tokenizer), m.vocab, f"data.tokenizer {d.tokenizer}")
    tokens = training_part(tokens, d.val_fraction)  # the held-out tail is never sampled
    sampler = GlobalBatchSampler(len(tokens.tokens), m.seq_len, cfg.train.global_batch, cfg.train.seed)
    return tokens, sampler


def _quiet(*_args) -> None:
    pass


def resume(cfg, state, engine, log) -> int:
    """Load the checkpoint `checkpoint.resume` names (if any) into this rank's slices; returns
    the step to continue from. The data order and LR schedule are functions of the step."""
    c = cfg.checkpoint
    if not c.resume:
        return 0
    found = find_resumable(c.dir, warn=log) if c.resume == "auto" else open_checkpoint(c.resume)
    if found is None:
        log(f"threefold: no checkpoint in {c.dir} yet: starting at step 0")
        return 0
    directory, manifest = found
    load_into(state, directory, manifest)
    refresh_params(engine, manifest.extra["optimizer_step"])  # working weights from the loaded masters
    engine.scaler.load_state_dict(manifest.extra.get("loss_scaler", {}))  # an fp16 run's dynamic scale
    log(f"threefold: resumed from {directory} at step {manifest.step}")
    return manifest.step


def initialize_from(cfg, state, engine, log) -> None:
    """Fine-tuning start: only the model weights of `checkpoint.init_from` (any layout, any
    dtype), into this rank's fp32 masters; Adam moments stay zero and the step count 0."""
    directory, manifest = open_checkpoint(cfg.checkpoint.init_from)
    load_into([t for t in state if t.name.startswith("model/")], directory, manifest)
    refresh_params(engine, 0)
    log(f"threefold: model weights from {directory} (step {manifest.step}); training starts at step 0")


def train(cfg, grid: Grid, device: torch.device, log=print, probe=None) -> dict:
    """Run cfg.train.steps steps; returns the last step's metrics. `probe` (threefold memory's
    MemoryProbe) watches the activations of each step's schedule and measures the model state
    after its optimizer step."""
    m, t = cfg.model, cfg.train
    is_logger = grid.global_rank == 0
    dtype = resolve_dtype(t.dtype, device)
    chunks, executor = build_stage(cfg, grid, device, partial(build_model, cfg, grid, device), dtype)
    model = nn.ModuleList(chunks)  # this rank's pipeline chunks (one without pipelining)
    tied = tied_head_weights(chunks, cfg, grid)  # the embedding and its copy on the last stage
    tied_copy = [w for c in chunks if c.tok_embed is None for w in tied_head_weights([c], cfg, grid)]
    precision = MixedPrecision.from_names(DTYPE_NAMES[dtype], t.grad_reduce_dtype, t.loss_scale,
                                          t.initial_loss_scale, t.loss_scale_window)
    engine = build_data_parallel(chunks, grid, zero=cfg.parallel.zero, bucket_mb=cfg.parallel.bucket_mb,
                                 precision=precision, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                                 own_bucket=tied)
    expert_load = ExpertLoad.of(chunks, cfg, device)
    tp_partial = partial_grad_params(model)
    if executor.store is not None:  # zero-bubble W passes add their dW through the engine
        executor.store.accumulate = engine.accumulate_grad
    state = training_state(chunks, engine, grid, aliases={id(w): "tok_embed.weight" for w in tied_copy})
    tokens, sampler = open_data(cfg)

    tokens_per_step = t.global_batch * m.seq_len
    flops_per_step = train_flops_per_token(m, m.seq_len) * tokens_per_step
    peak = device_peak_flops(device, dtype, threads=t.threads if device.type == "cpu" else None,
                             cache_dir=cfg.data.cache_dir)
    world = grid.layout.world_size
    p = cfg.parallel
    bubble = bubble_theory(p.schedule, p.pp, p.microbatches, p.vpp) if p.pp > 1 else 0.0
    start_step = resume(cfg, state, engine, log if is_logger else _quiet)
    if start_step == 0 and cfg.checkpoint.init_from:
        initialize_from(cfg, state, engine, log if is_logger else _quiet)
    metrics = MetricsWriter(cfg.log.dir, enabled=is_logger, append=continues_run(start_step),
                            tensorboard=cfg.log.tensorboard)
    guard = RunGuard(cfg, grid, chunks, state, start_step, log if is_logger else _quiet, engine.scaler)
    observer = StepObserver(cfg.log, grid, device, is_logger)  # log.spans: where each rank's step time went
    observer.attach(chunks, engine)
    phase = observer.phase  # from here on, until the next phase(), the step's time counts as this category
    if is_logger:
        write_run_json(cfg.log.dir, cfg.to_dict(), grid.describe(), device=device,
                       extra={"data": tokens.source, "peak_flops_per_device": peak, "dtype": str(dtype),
                              "train_flops_per_token": flops_per_step / tokens_per_step})
    status = StatusLine(t.steps, cfg.log.interval, enabled=is_logger and not cfg.log.quiet)
    heldout = HeldOut(cfg) if t.eval_every else None

    def produce(step: int):
        return sampler.microbatches(tokens.tokens, step, grid.dp_rank, grid.layout.dp, t.micro_batch)

    last = {}
    with Prefetcher(produce, start_step, t.steps, depth=cfg.data.prefetch) as prefetch:
        for step in range(start_step, t.steps):
            guard.step_begins(step)
            observer.begin_step(step)
            t0 = time.perf_counter()
            tp_bytes0 = grid.tp.stats.total_bytes
            phase("data_wait")
            batches, data_wait = prefetch.get(step)
            phase("other")
            lr = lr_at(step, t)
            expert_load.set_loss_weight(engine.loss_scale)
            # Forward/backward of every micro-batch through this rank's stage, in schedule order;
            # each chunk's last backward runs outside no_sync so its gradient buckets start
            # reducing over dp while the rest of backward still runs.
            with probe.watch(chunks) if probe else contextlib.nullcontext():
                loss_sum, pipe = executor.run(batches, tokens_per_step / engine.loss_scale, no_sync=engine.no_sync,
                                              spans=observer.recorder)
            compute_s = guard.compute_time(step, pipe)
            phase("dp_exposed")
            engine.finish()
            # Tensor parallel: replicated parameters whose gradient each TP rank holds a part of
            # (norms under SP, kv heads shared when kv_heads < tp) are summed over the TP group;
            # the embedding and its last-stage copy over the first and last stage.
            phase("tp_comm")
            engine.all_reduce_grads_of(tp_partial, grid.tp)
            phase("sync")
            if tied:
                engine.all_reduce_grads_of(tied, grid.embed)
            phase("optimizer")
            grad_norm = engine.grad_norm([grid.pp], exclude=tied_copy)
            # One all_gather: a NaN/Inf on any rank makes every rank skip; stragglers are named.
            grad_norm = guard.agree(grad_norm, loss_sum, compute_s, engine)
            applied = engine.step(lr, grad_norm, t.grad_clip)
            if probe:
                probe.after_step(engine)
            engine.zero_grad()
            phase("sync")
            all_reduce_sum(loss_sum, grid.pp)  # only the last stage computed a loss
            all_reduce_sum(loss_sum, grid.dp)
            # One small MAX reduction gives the slowest rank's memory, data wait and pipeline idle.
            worst = all_reduce_max(torch.tensor([float(peak_memory_bytes(device)), data_wait, pipe.recv_wait_s,
                                                 pipe.idle_fraction]), grid.world)
            loss_value, norm_value = loss_sum.item() / tokens_per_step, grad_norm.item()
            step_time = time.perf_counter() - t0
            phase("other")
            tflops = flops_per_step / world / step_time / 1e12
            last = {
                "step": step + 1, "time": time.time(), "loss": loss_value, "grad_norm": norm_value, "lr": lr,
                "tokens": (step + 1) * tokens_per_step, "step_time_s": step_time,
                "tokens_per_s": tokens_per_step / step_time, "model_tflops_per_device": tflops,
                "mfu": mfu(tflops * 1e12, peak), "peak_mem_bytes": int(worst[0]), "data_wait_s": float(worst[1]),
                "tp_comm_bytes": grid.tp.stats.total_bytes - tp_bytes0,
                "pp_idle_s": float(worst[2]), "pp_idle_fraction": float(worst[3]),
                "pp_bubble_theory": bubble,
                "dp_exposed_s": engine.comm_stats()["dp_exposed_s"], "loss_scale": engine.loss_scale,
                "step_skipped": not applied,
            }
            last.update(expert_load.collect(grid.world))
            if heldout is not None and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
                phase("eval")
                last["val_loss"] = heldout.evaluate(chunks, grid, cfg)["loss"]
            # Health counters, the checkpoint when one is due (after step_time: a save blocks the
            # run and is reported as its own category), goodput.
            guard.end_step(step, last, before_save=lambda: phase("checkpoint"))
            last.update(observer.end_step(engine))
            metrics.write(last)
            if last.get("moe_hot_experts") and is_logger and (step + 1) % cfg.log.interval == 0:
                log(f"threefold: step {step + 1}: experts above 2x their layer's mean load: "
                    f"{', '.join(last['moe_hot_experts'])}")
            status.update(step, loss_value, last["tokens_per_s"], last["mfu"])
            guard.check_rollback(step, metrics)
        guard.close()
    metrics.close()
    observer.close()
    if probe:
        return probe.gather(cfg, grid, chunks, dtype)
    return last
