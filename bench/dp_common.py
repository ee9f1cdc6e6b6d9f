"""Shared pieces of the data-parallel benchmarks: spawn gloo ranks, build the model and its
batches, count the bytes of model state."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)  # one intra-op thread per rank (FIELD-NOTES: essential on CPU)
    try:
        queue.put((rank, fn(*args)))
    except BaseException:
        queue.put((rank, RuntimeError(traceback.format_exc())))


def spawn(fn, world: int, *args, timeout: float = 900.0) -> list:
    """fn(*args) in `world` processes (gloo on CPU); per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, value = queue.get(timeout=timeout)
            if isinstance(value, Exception):
                raise value
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def make_cfg(**overrides):
    """The data-parallel benches' run, validated: tiny llama, seq 64, 8 sequences per rank and
    step, constant lr (both sides step at train.lr)."""
    from threefold.config import build_config
    from threefold.validate import validate

    base = {
        "model.preset": "tiny",
        "model.seq_len": 64,
        "train.global_batch": 16,
        "train.micro_batch": 8,
        "train.warmup_steps": 0,
        "train.min_lr_ratio": 1.0,
        "train.steps": 1000,
    }
    return validate(build_config(None, [(k, str(v)) for k, v in {**base, **overrides}.items()]))


def batches(cfg, dp_rank: int, dp: int, steps: int) -> list:
    """This rank's micro-batches for `steps` steps, prepared up front (data is not timed)."""
    from threefold.data import GlobalBatchSampler, load_tokens

    tokens = load_tokens(cfg.data.path, cfg.data.vocab, cfg.data.dtype, cfg.data.cache_dir)
    sampler = GlobalBatchSampler(len(tokens.tokens), cfg.model.seq_len, cfg.train.global_batch, cfg.train.seed)
    return [sampler.microbatches(tokens.tokens, s, dp_rank, dp, cfg.train.micro_batch) for s in range(steps)]


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total
