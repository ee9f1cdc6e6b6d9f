"""PyTorch's composable 3D stack as a benchmark contestant: DTensor tensor parallelism inside
FSDP2 over the dp dimension of one (pp, dp, tp) DeviceMesh, stages run by
torch.distributed.pipelining (see bench/threed_vs_torch.py for the side-by-side)."""
from __future__ import annotations

SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


def _tp_plan(chunk, tp_mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if chunk.tok_embed is not None:
        parallelize_module(chunk, tp_mesh, {"tok_embed": RowwiseParallel(input_layouts=Replicate(),
                                                                          output_layouts=Replicate())})
    if chunk.head is not None:  # logits stay vocab-sharded; loss_parallel computes the loss on them
        parallelize_module(chunk, tp_mesh, {"head": ColwiseParallel(input_layouts=Replicate(),
                                                                     output_layouts=Shard(-1),
                                                                     use_local_output=False)})
    for block in chunk.layers.values():
        parallelize_module(block, tp_mesh, {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(), "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel()})


def torch_contestant(cfg, schedule: str, mesh, n_local_tokens: int):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from threefold.distributed.pipeline.partition import stage_layer_ids
    from threefold.model.meta import plain_model
    from threefold.train.optim import param_groups

    t, p = cfg.train, cfg.parallel.pp
    r = mesh["pp"].get_local_rank()
    first, last = r == 0, r == p - 1
    # the same layout-invariant values threefold's chunks hold
    chunk = plain_model(cfg.model, t.seed, "cpu", stage_layer_ids(cfg.model, p, 1, cfg.parallel.stage_layers)[r],
                        first, last)
    _tp_plan(chunk, mesh["tp"])
    for block in chunk.layers.values():
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(chunk, mesh=mesh["dp"], reshard_after_forward=False)
    stage = pipelining.PipelineStage(chunk, r, p, torch.device("cpu"), group=mesh["pp"].get_group())

    def loss_fn(logits, targets):  # summed cross-entropy / the dp rank's tokens (FSDP2 averages over dp)
        return F.cross_entropy(logits.flatten(0, -2), targets.t().flatten(), reduction="sum") / n_local_tokens

    sched = getattr(pipelining, SCHEDULES[schedule])(stage, n_microbatches=cfg.parallel.microbatches,
                                                     loss_fn=loss_fn, scale_grads=False)
    opt = torch.optim.AdamW(param_groups(chunk, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                            foreach=False)
    params = list(chunk.parameters())
    pp_group = mesh["pp"].get_group()
    memory = {}

    def grad_norm() -> torch.Tensor:
        """sqrt(sum over pp of per-mesh DTensor norms squared): torchtitan's clip_grad_norm_."""
        by_mesh: dict = {}
        for q in params:
            if q.grad is not None:
                by_mesh.setdefault(q.grad.device_mesh if isinstance(q.grad, DTensor) else None, []).append(q.grad)
        sq = torch.zeros((), dtype=torch.float32)
        for grads in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(grads, foreach=False)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            sq = sq + norm.float() ** 2
        dist.all_reduce(sq, group=pp_group)
        return sq.sqrt()

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
        norm = grad_norm()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip, norm, foreach=False)
        opt.step()
        if not memory:
            local = [q.to_local() for q in params] + [q.grad.to_local() for q in params if q.grad is not None]
            local += [v.to_local() if isinstance(v, DTensor) else v
                      for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
            memory["measured"] = sum(v.numel() * v.element_size() for v in local)
        opt.zero_grad(set_to_none=True)
        if not last:
            return None
        total = sum(v.full_tensor() if isinstance(v, DTensor) else v for v in losses)
        return float(total.detach()) * n_local_tokens  # summed token loss of this dp rank's batch

    return step, memory
