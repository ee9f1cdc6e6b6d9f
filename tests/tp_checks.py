"""Checks run inside the spawned ranks of tests/distributed/test_tensor_parallel.py.

One spawned process group runs many checks (spawning is the slow part on a small CPU box):
each check compares a tensor-parallel layer or model with an unsharded reference built from
the same seed on every rank, and returns {what was compared: (largest difference, bound)}; the
test asserts each with harness.within, so `pytest --tolerances` lists them all.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from threefold.config import Config, build_config
from threefold.distributed.data_parallel import DataParallel
from threefold.distributed.finalize import finalize_grads
from threefold.distributed.grid import Grid, Group, RankLayout
from threefold.distributed.parallelize import build_model
from threefold.distributed.runtime import init_distributed, shutdown_distributed
from threefold.distributed.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from threefold.distributed.tensor_parallel.mappings import gather_from_tensor_region
from threefold.model.sharding import partial_params
from threefold.validate import validate

from harness import train_configs


class Diffs(dict):
    """kind -> (largest |got - want| over the comparisons of that kind, its bound, which one)."""

    def close(self, kind: str, got: torch.Tensor, want: torch.Tensor, bound: float = 1e-5, label: str = "") -> None:
        if got.shape != want.shape:
            raise AssertionError(
                f"rank {dist.get_rank()} {kind} {label}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
            )
        diff = (got.detach() - want.detach()).abs().max().item() if got.numel() else 0.0
        if kind not in self or diff > self[kind][0]:
            self[kind] = (diff, bound, label)


def shard(full: torch.Tensor, spec) -> torch.Tensor:
    return full.narrow(spec.dim, spec.start, spec.length)


def seq_shard(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x.chunk(group.size, 0)[group.rank]


def _load(parallel: nn.Module, ref: nn.Module) -> None:
    with torch.no_grad():
        for name, p in parallel.named_parameters():
            spec = getattr(parallel, "shard_specs", {}).get(name)
            full = getattr(ref, name)
            p.copy_(full if spec is None else shard(full, spec))


def _grad_of(module: nn.Module, name: str, ref: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    spec = getattr(module, "shard_specs", {}).get(name)
    full = getattr(ref, name).grad
    return getattr(module, name).grad, full if spec is None else shard(full, spec)


def check_layers(tp: Group, sp: bool) -> Diffs:
    """Column/row linear, vocab embedding and cross-entropy against torch's layers."""
    torch.manual_seed(0)
    s, b, h, f, vocab = 8, 2, 12, 16, 24
    d = Diffs()
    # Column-parallel: output features split; input copied (or gathered from sequence shards);
    # with overlap its dW is computed by the entry while the dX collective is in flight.
    for overlap in (False, True):
        torch.manual_seed(0)
        tag = "column" + (" overlap" if overlap else "")
        ref, col = nn.Linear(h, f), ColumnParallelLinear(h, f, tp, bias=True, sp=sp, overlap=overlap)
        _load(col, ref)
        x, gy = torch.randn(s, b, h), torch.randn(s, b, f)
        xr, xl = x.clone().requires_grad_(), (seq_shard(x, tp) if sp else x).clone().requires_grad_()
        yr, yl = ref(xr), col(xl)
        spec = col.shard_specs["weight"]
        (yr * gy).sum().backward()
        (yl * shard(gy, SimpleNamespace(dim=2, start=spec.start, length=spec.length))).sum().backward()
        d.close(f"{tag} out", yl, yr[..., spec.start : spec.start + spec.length])
        d.close(f"{tag} gathered", gather_from_tensor_region(yl.detach(), tp), yr)
        for name in ("weight", "bias"):
            d.close(f"{tag} d{name}", *_grad_of(col, name, ref))
        d.close(f"{tag} dx", xl.grad, seq_shard(xr.grad, tp) if sp else xr.grad)
    # Row-parallel: input features split; partial outputs all-reduced (reduce-scattered under SP).
    ref, row = nn.Linear(f, h), RowParallelLinear(f, h, tp, bias=True, sp=sp)
    _load(row, ref)
    spec = row.shard_specs["weight"]
    x, gy = torch.randn(s, b, f), torch.randn(s, b, h)
    xr = x.clone().requires_grad_()
    xl = x[..., spec.start : spec.start + spec.length].clone().requires_grad_()
    yr, yl = ref(xr), row(xl)
    (yr * gy).sum().backward()
    (yl * (seq_shard(gy, tp) if sp else gy)).sum().backward()
    d.close("row out", yl, seq_shard(yr, tp) if sp else yr)
    d.close("row dweight", *_grad_of(row, "weight", ref))
    d.close("row dx", xl.grad, xr.grad[..., spec.start : spec.start + spec.length])
    if sp:  # each rank added the bias to its own rows: a partial gradient, summed over the group
        dist.all_reduce(row.bias.grad, group=tp.pg)
    d.close("row dbias", row.bias.grad, ref.bias.grad)
    # Vocab-parallel embedding.
    ref, emb = nn.Embedding(vocab, h), VocabParallelEmbedding(vocab, h, tp, scatter=sp)
    _load(emb, ref)
    ids, gy = torch.randint(0, vocab, (s, b)), torch.randn(s, b, h)
    yr, yl = ref(ids), emb(ids)
    (yr * gy).sum().backward()
    (yl * (seq_shard(gy, tp) if sp else gy)).sum().backward()
    d.close("embedding out", yl, seq_shard(yr, tp) if sp else yr)
    d.close("embedding dweight", *_grad_of(emb, "weight", ref))
    # Vocab-parallel cross-entropy: the logits are never gathered.
    logits, targets = torch.randn(s, b, vocab) * 3, torch.randint(0, vocab, (s, b))
    lr = logits.clone().requires_grad_()
    n = vocab // tp.size
    ll = logits[..., tp.rank * n : (tp.rank + 1) * n].clone().requires_grad_()
    loss_r = F.cross_entropy(lr.flatten(0, 1), targets.flatten(), reduction="sum")
    loss_l = vocab_parallel_cross_entropy(ll, targets, tp, rows=3)  # several fp32 chunks of tokens
    (loss_r * 0.5).backward()
    (loss_l * 0.5).backward()
    d.close("cross-entropy per token", loss_l / targets.numel(), loss_r / targets.numel())
    d.close("cross-entropy dlogits", ll.grad, lr.grad[..., tp.rank * n : (tp.rank + 1) * n])
    return d


def reference_grid() -> SimpleNamespace:
    """The grid of an unsharded model (tp 1), usable inside a multi-rank job."""
    one = {name: Group(name, [0], None) for name in ("tp", "ep", "cp")}
    return SimpleNamespace(**one, dp_rank=0, pp_rank=0, tp_rank=0, cp_rank=0)


def model_config(overrides: dict) -> Config:
    return build_config(None, [(k, str(v)) for k, v in overrides.items()])


def _specs(model: nn.Module) -> dict:
    out = {}
    for mod_name, module in model.named_modules():
        for pname, spec in getattr(module, "shard_specs", {}).items():
            out[f"{mod_name}.{pname}" if mod_name else pname] = spec
    return out


def with_engine(model: nn.Module, grid: Grid) -> DataParallel:
    """The data-parallel engine training would wrap `model` in (dp 1 here): its buckets hold the
    gradients (param.grad are views of them), so finalize() below is the production path."""
    return DataParallel(model, grid)


def finalize(model: nn.Module, engine: DataParallel, grid: Grid) -> None:
    """Every reduction after backward, as the trainer runs them (TP partial sums included)."""
    finalize_grads(engine, grid, partial_params([model]), [], [])


def check_model(grid: Grid, overrides: dict) -> Diffs:
    """A whole tensor-parallel model against the unsharded one: init, loss, logits, every gradient."""
    cfg = model_config(overrides)
    ref_cfg = model_config({**overrides, "parallel.tp": 1, "parallel.sp": False})
    ref = build_model(ref_cfg, reference_grid(), torch.device("cpu"))
    model = build_model(cfg, grid, torch.device("cpu"))
    engine = with_engine(model, grid)
    specs, full = _specs(model), dict(ref.named_parameters())
    d = Diffs()
    for name, p in model.named_parameters():
        want = full[name] if name not in specs else shard(full[name], specs[name])
        d.close("init", p, want, bound=0, label=name)
    torch.manual_seed(1)
    m = cfg.model
    tokens, targets = torch.randint(0, m.vocab, (3, m.seq_len)), torch.randint(0, m.vocab, (3, m.seq_len))
    loss_r, loss_l = ref(tokens, targets), model(tokens, targets)
    d.close("loss per token", loss_l / tokens.numel(), loss_r / tokens.numel(), bound=5e-6)
    (loss_r / tokens.numel()).backward()
    (loss_l / tokens.numel()).backward()
    finalize(model, engine, grid)
    for name, p in model.named_parameters():
        want = full[name].grad if name not in specs else shard(full[name].grad, specs[name])
        d.close("grad", p.grad, want, bound=2e-6, label=name)
    with torch.no_grad():
        logits_l, logits_r = model(tokens), ref(tokens)
        d.close("logits", gather_from_tensor_region(logits_l, grid.tp), logits_r, bound=6e-6)
    return d


def comm_volume(grid: Grid, overrides: dict) -> dict:
    """TP traffic of one block's forward+backward, and of one whole micro-batch (+ grad sync)."""
    cfg = model_config(overrides)
    model = build_model(cfg, grid, torch.device("cpu"))
    engine = with_engine(model, grid)
    m, stats = cfg.model, grid.tp.stats
    b, s = 2, m.seq_len
    rows = s // grid.tp.size if cfg.parallel.sp else s
    stats.reset()
    x = torch.randn(rows, b, m.hidden, requires_grad=True)
    out = model.layers["0"](x)
    out.backward(torch.randn_like(out))
    block = stats.snapshot()
    model.zero_grad(set_to_none=True)
    stats.reset()
    tokens = torch.randint(0, m.vocab, (b, s))
    model(tokens, tokens).backward()
    step = stats.snapshot()
    stats.reset()
    finalize(model, engine, grid)
    return {"block": block, "microbatch": step, "grad_sync": stats.snapshot(), "batch": b}


def dropout_recompute(grid: Grid, overrides: dict) -> Diffs:
    """With dropout, recompute full/selective reproduce the masks of recompute none exactly."""
    grads = {}
    for mode in ("none", "selective", "full"):
        cfg = model_config({**overrides, "train.recompute": mode})
        model = build_model(cfg, grid, torch.device("cpu"))  # also seeds the dropout generator
        engine = with_engine(model, grid)
        m = cfg.model
        tokens = torch.randint(0, m.vocab, (2, m.seq_len), generator=torch.Generator().manual_seed(2))
        model(tokens, tokens).backward()
        finalize(model, engine, grid)
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    d = Diffs()
    for mode in ("selective", "full"):
        for g, ref in zip(grads[mode], grads["none"]):
            d.close(f"dropout grads {mode}", g, ref, bound=0)
    return d


def activation_memory(grid: Grid, overrides: dict, batch: int) -> dict:
    """Bytes per layer autograd saves on this rank (SavedTensorMeter), for the formula test."""
    from threefold.model.activations import SavedTensorMeter
    from threefold.model.layers import rope_tables

    cfg = model_config(overrides)
    model, m = build_model(cfg, grid, torch.device("cpu")), cfg.model
    tables = rope_tables(m.seq_len, m.head_dim, m.rope_theta, torch.device("cpu"))
    tokens = torch.randint(0, m.vocab, (batch, m.seq_len), generator=torch.Generator().manual_seed(3))
    with SavedTensorMeter(model, exclude=list(tables)) as meter:
        loss = model(tokens, tokens)
    loss.backward()
    return {"per_layer": meter.per_layer(), "by_scope": dict(meter.by_scope)}


def run_plan(world: int, plan: list[tuple[str, dict]]) -> list:
    """Entry point of each spawned rank: join the group, run the checks in order, leave."""
    init_distributed(torch.device("cpu"), timeout_s=120)
    grid = Grid.build(RankLayout(tp=world))
    results = []
    for kind, kwargs in plan:
        if kind == "layers":
            results.append(check_layers(grid.tp, **kwargs))
        elif kind == "model":
            results.append(check_model(grid, kwargs))
        elif kind == "comm":
            results.append(comm_volume(grid, kwargs))
        elif kind == "dropout":
            results.append(dropout_recompute(grid, kwargs))
        elif kind == "memory":
            results.append(activation_memory(grid, kwargs["overrides"], kwargs["batch"]))
        elif kind == "train":
            results.append(train_configs(kwargs["jobs"]))
        else:
            raise ValueError(kind)
    shutdown_distributed()
    return results


def resolved(overrides: dict, log_dir, cache_dir: str, world: int) -> dict:
    pairs = [(k, str(v)) for k, v in overrides.items()]
    pairs += [("log.dir", str(log_dir)), ("data.cache_dir", cache_dir), ("log.quiet", "true")]
    cfg = build_config(None, pairs)
    return validate(cfg, world).to_dict()
