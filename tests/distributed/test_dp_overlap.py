"""Overlap of the data-parallel gradient reduction with backward: buckets leave during the
last micro-batch's backward, and what is left once backward ends, measured against the
blocking cost of the same collectives."""

from __future__ import annotations

import contextlib
import hashlib
import statistics

import torch
import torch.distributed as dist

from threefold.distributed.data_parallel import DataParallel
from threefold.distributed.parallelize import build_model

from dp_checks import CPU, make_cfg, make_grid, open_data
from harness import run_ranks


def _dp2(data: str):
    """This worker's gloo process group, config, grid and data at dp 2, and tokens per step."""
    dist.init_process_group("gloo")
    cfg = make_cfg(data, **{"parallel.dp": 2})
    grid = make_grid([0, 1], dist.group.WORLD)
    tokens, sampler = open_data(cfg)
    per_step = cfg.train.global_batch * cfg.model.seq_len
    return cfg, grid, tokens, sampler, per_step


def _overlap_worker(data: str) -> dict:
    """dp 2, ZeRO 0 and 2, small buckets: are buckets launched inside backward, and how much of
    the reduction is left once the slower rank's backward has ended?"""
    cfg, grid, tokens, sampler, per_step = _dp2(data)
    out = {}
    for zero in (0, 2):
        model = build_model(cfg, grid, CPU)
        engine = DataParallel(model, grid, zero=zero, bucket_mb=0.125)
        launched, exposed = [], []
        for step in range(6):
            batches = sampler.microbatches(tokens.tokens, step, grid.dp_rank, 2, cfg.train.micro_batch)
            for i, (x, y) in enumerate(batches):
                with engine.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                    engine.backward(model(x, y) / per_step)
                launched.append(engine.grads.launched_in_backward)
            engine.finish()
            exposed.append(engine.exposed_comm_s())
            engine.step(1e-3, engine.grad_norm(), 1.0)
            engine.zero_grad()
        serial = engine.time_serial_comm(repeats=5)
        out[zero] = {
            "buckets": len(engine.layout.buckets),
            "launched": launched,
            "serial_s": serial,
            "exposed_s": statistics.median(exposed[2:]),
        }
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_bucket_reduction_overlaps_backward(data):
    """Buckets leave during the synchronized backward, none during no_sync ones; prints how
    much communication was left after the slower rank's backward ended."""
    results = run_ranks(_overlap_worker, 2, data, timeout=180)
    for zero in (0, 2):
        res = results[0][zero]
        n = res["buckets"]
        assert n >= 2
        # Nothing is sent during no_sync micro-batches; every bucket leaves during the last backward.
        assert res["launched"] == [0, n] * 6
        hidden = [1 - r[zero]["exposed_s"] / r[zero]["serial_s"] for r in results]
        print(
            f"\nzero {zero}: {n} buckets, serial {res['serial_s'] * 1e3:.1f} ms, exposed "
            f"{[round(r[zero]['exposed_s'] * 1e3, 2) for r in results]} ms, hidden {[round(h, 3) for h in hidden]}"
        )
        # Not asserted here: with a real CPU backward on two shared cores the hidden fraction ranges
        # 0.2-0.99 from run to run (gloo's thread competes with backward for the CPU). The >= 70%
        # goal is asserted where backward leaves the host free, as device compute does
        # (test_reduction_is_hidden_behind_backward), and measured by bench/dp_vs_ddp.py.


class _BusyBackward(torch.autograd.Function):
    """Identity whose backward keeps the host away for `seconds`, as device compute would: the
    CPU is free meanwhile, so what overlap can hide depends on the engine alone."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(ctx.seconds)
        return grad, None


class _SlowBackwardStack(torch.nn.Module):
    """Six 4 MiB layers whose gradients leave in their own buckets, then two small first layers
    (the last bucket, which no backward can hide). Buckets this size make the reductions long
    next to the scheduler's noise of a few milliseconds on shared cores."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(1024, 8)
        self.up = torch.nn.Linear(8, 1024)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(6))

    def forward(self, x):
        # Backward computes (sleeps) after every big layer's gradient, the first one's included,
        # so only the small last bucket's reduction can be left when backward ends.
        x = _BusyBackward.apply(self.up(self.first(x)), 0.05)
        for layer in self.layers:
            x = _BusyBackward.apply(layer(x), 0.05)
        return x.square().mean()


def _hidden_worker() -> dict:
    dist.init_process_group("gloo")
    grid = make_grid([0, 1], dist.group.WORLD)
    out = {}
    for zero in (0, 2):
        torch.manual_seed(0)
        model = _SlowBackwardStack()
        engine = DataParallel(model, grid, zero=zero, bucket_mb=4.0)
        x = torch.randn(4, 1024)
        exposed = []
        for _ in range(6):
            engine.backward(model(x))
            engine.finish()
            exposed.append(engine.exposed_comm_s())
            engine.step(1e-3, engine.grad_norm(), 1.0)
            engine.zero_grad()
        out[zero] = {
            "buckets": len(engine.layout.buckets),
            "serial_s": engine.time_serial_comm(repeats=7),
            "exposed_s": statistics.median(exposed[1:]),
        }
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_reduction_is_hidden_behind_backward(cache_dir):
    """Done-when of data parallelism: with >= 2 buckets at least 70% of the gradient
    communication is hidden behind backward, for all-reduce (ZeRO 0) and reduce-scatter (ZeRO 2)."""
    results = run_ranks(_hidden_worker, 2, timeout=180)
    for zero in (0, 2):
        res = results[0][zero]
        assert res["buckets"] >= 7
        hidden = 1 - res["exposed_s"] / res["serial_s"]
        print(
            f"\nzero {zero}: {res['buckets']} buckets, serial {res['serial_s'] * 1e3:.2f} ms, exposed "
            f"{res['exposed_s'] * 1e3:.2f} ms, hidden {hidden:.3f}"
        )
        assert hidden >= 0.7


def _oplog_worker(data: str) -> dict:
    """dp 2, every ZeRO stage, two steps of two micro-batches: what the dp group's OpLog says
    afterwards (hang attribution reads it: every wait the engine did must count as completed)."""
    cfg, grid, tokens, sampler, per_step = _dp2(data)
    out = {}
    for zero in (0, 1, 2, 3):
        model = build_model(cfg, grid, CPU)
        engine = DataParallel(model, grid, zero=zero, bucket_mb=0.125)
        for step in range(2):
            batches = sampler.microbatches(tokens.tokens, step, grid.dp_rank, 2, cfg.train.micro_batch)
            for i, (x, y) in enumerate(batches):
                with engine.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                    engine.backward(model(x, y) / per_step)
            engine.finish()
            engine.step(1e-3, engine.grad_norm(), 1.0)
            engine.zero_grad()
        engine.wait_params()  # ZeRO 1/2's last gathers wait for the next forward, which is not run
        ops = engine.group.ops
        out[zero] = (ops.posted - ops.completed, len(ops._open), ops.posted)
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_every_wait_of_the_engine_completes_its_operation(data):
    """The buckets' reductions and ZeRO's gathers, waited on where the engine times them, still
    advance the group's completed count: a clean run leaves nothing open to blame a hang on."""
    results = run_ranks(_oplog_worker, 2, data, timeout=180)
    for rank in (0, 1):
        for zero, (open_ops, handles, posted) in results[rank].items():
            assert posted > 0 and (open_ops, handles) == (0, 0), (rank, zero, open_ops, handles, posted)


def _gather_parity_worker(data: str) -> dict:
    """dp 2 on a grid with the all-gather lane, two micro-batches per rank: six Trainer steps of
    ZeRO 1 and 2 (fp32, and bf16 with its separate fp32 master) with the parameter gather
    overlapped and not. Per run: the losses, the parameters after the last step, and how many
    gathers were still in flight when each step returned."""
    from threefold.distributed.grid import Grid, RankLayout
    from threefold.training.trainer import Trainer

    from dp_checks import flat_params

    dist.init_process_group("gloo")
    grid = Grid.build(RankLayout(dp=2), lanes=("dp_cp",))
    out = {}
    for zero, dtype in ((1, "fp32"), (2, "fp32"), (1, "bf16")):
        for overlap in (True, False):
            cfg = make_cfg(
                data,
                **{
                    "parallel.dp": 2,
                    "parallel.zero": zero,
                    "train.dtype": dtype,
                    "parallel.bucket_mb": 0.25,
                    "parallel.overlap_param_gather": overlap,
                },
            )
            trainer = Trainer(cfg, grid, CPU, log=lambda *args: None)
            engine = trainer.engine
            losses, pending = [], []
            for step in range(6):
                losses.append(trainer.train_step(step).loss)
                pending.append(engine.param_gather.pending)
            out[(zero, dtype, overlap)] = {
                "losses": losses,
                "params": hashlib.sha256(flat_params(engine.full_parameters()).numpy().tobytes()).hexdigest(),
                "pending": pending,
                "buckets": len(engine.layout.buckets),
                "lane": engine.gather_group is not engine.group and engine.gather_group.pg is not None,
            }
            engine.close()
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_overlapped_param_gather_is_bitwise_todays(data):
    """ZeRO 1/2 with parallel.overlap_param_gather (each bucket's all-gather launched after its
    update on the all-gather lane, waited for by the next forward's first use) trains the very
    bits of the gather done inside the step, with gradient accumulation; and the gathers are
    really left in flight when the step returns."""
    results = run_ranks(_gather_parity_worker, 2, data, timeout=240)
    for rank, res in enumerate(results):
        for zero, dtype in ((1, "fp32"), (2, "fp32"), (1, "bf16")):
            on, off = res[(zero, dtype, True)], res[(zero, dtype, False)]
            assert on["lane"] and on["buckets"] >= 2, (rank, zero, dtype)
            assert on["losses"] == off["losses"], (rank, zero, dtype, on["losses"], off["losses"])
            assert on["params"] == off["params"], (rank, zero, dtype)
            assert on["pending"] == [on["buckets"]] * 6 and off["pending"] == [0] * 6, (on["pending"], off["pending"])
