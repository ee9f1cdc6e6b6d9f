"""PyTorch's composable 3D stack as a benchmark contestant: DTensor tensor parallelism inside
FSDP2 over the dp dimension of one (pp, dp, tp) DeviceMesh, stages run by
torch.distributed.pipelining (see bench/threed_vs_torch.py for the side-by-side)."""

from __future__ import annotations

SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


def _tp_plan(chunk, tp_mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if chunk.tok_embed is not None:
        parallelize_module(
            chunk, tp_mesh, {"tok_embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
        )
    if chunk.head is not None:  # logits stay vocab-sharded; loss_parallel computes the loss on them
        parallelize_module(
            chunk,
            tp_mesh,
            {"head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)},
        )
    for block in chunk.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn.wq": ColwiseParallel(),
                "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(),
                "mlp.w1": ColwiseParallel(),
                "mlp.w3": ColwiseParallel(),
                "mlp.w2": RowwiseParallel(),
            },
        )


def torch_contestant(cfg, schedule: str, mesh, n_local_tokens: int):
    import torch
    import torch.nn.functional as F
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch_peers import MeshOptimizer

    from threefold.distributed.pipeline.partition import stage_layer_ids
    from threefold.model.meta import plain_model

    t, p = cfg.train, cfg.parallel.pp
    r = mesh["pp"].get_local_rank()
    first, last = r == 0, r == p - 1
    # the same layout-invariant values threefold's chunks hold
    chunk = plain_model(
        cfg.model, t.seed, "cpu", stage_layer_ids(cfg.model, p, 1, cfg.parallel.stage_layers)[r], first, last
    )
    # The 2-D (dp, tp) gradient norms reduce over a flattened dp x tp group: one all-reduce, not
    # one per mesh dimension (DTensor's own advice; torchtitan flattens its meshes likewise).
    mesh["dp", "tp"]._flatten()
    _tp_plan(chunk, mesh["tp"])
    for block in chunk.layers.values():
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(chunk, mesh=mesh["dp"], reshard_after_forward=False)
    stage = pipelining.PipelineStage(chunk, r, p, torch.device("cpu"), group=mesh["pp"].get_group())

    def loss_fn(logits, targets):  # summed cross-entropy / the dp rank's tokens (FSDP2 averages over dp)
        return F.cross_entropy(logits.flatten(0, -2), targets.t().flatten(), reduction="sum") / n_local_tokens

    sched = getattr(pipelining, SCHEDULES[schedule])(
        stage, n_microbatches=cfg.parallel.microbatches, loss_fn=loss_fn, scale_grads=False
    )
    # Per-mesh norms summed over pp: torchtitan's clip_grad_norm_ for pipelined FSDP2 + TP.
    opt = MeshOptimizer(chunk, t, norm_groups=(mesh["pp"].get_group(),))
    params = list(chunk.parameters())
    memory = {"optimizer": opt.describe()}

    def step(micro, n_tokens):
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        losses: list = []
        with loss_parallel():
            if first:
                sched.step(x)
            elif last:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
        opt.clip(t.grad_clip, opt.grad_norm())
        opt.step()
        if "measured" not in memory:
            local = [q.to_local() for q in params] + [q.grad.to_local() for q in params if q.grad is not None]
            memory["measured"] = sum(v.numel() * v.element_size() for v in local + opt.state_tensors())
        opt.zero_grad()
        if not last:
            return None
        total = sum(v.full_tensor() if isinstance(v, DTensor) else v for v in losses)
        return float(total.detach()) * n_local_tokens  # summed token loss of this dp rank's batch

    return step, memory
