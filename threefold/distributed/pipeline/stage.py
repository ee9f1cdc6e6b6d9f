"""This rank's pipeline stage: its model chunks, its schedule, its executor, and the tied
embedding that the first and last stages share."""

from __future__ import annotations

import torch
from torch import nn

from threefold.config import Config
from threefold.data.documents import document_separator
from threefold.distributed.grid import Grid
from threefold.distributed.pipeline.executor import PipelineExecutor, StagePlan
from threefold.distributed.pipeline.p2p import WireFormat
from threefold.distributed.pipeline.partition import stage_layer_ids
from threefold.distributed.pipeline.schedules import build_schedule
from threefold.distributed.pipeline.weight_grad import WeightGradStore, attach_weight_grad_store


def build_stage(
    cfg: Config, grid: Grid, device: torch.device, build_chunk, dtype: torch.dtype = torch.float32
) -> tuple[list[nn.Module], PipelineExecutor]:
    """`build_chunk(layer_ids, first, last)` builds one materialized, initialized chunk;
    activations cross stage boundaries in `dtype` (the parameters' dtype). Under ZeRO 3 over
    dp > 1 it is called with `defer_init=True` (as parallelize.build_model takes it): the
    data-parallel engine, which must be built next, materializes the parameters unit by unit."""
    p, v = cfg.parallel.pp, cfg.parallel.vpp
    stages = stage_layer_ids(cfg.model, p, v, cfg.parallel.stage_layers)
    defer = {"defer_init": True} if cfg.parallel.zero == 3 and grid.dp_cp.size > 1 else {}
    chunks, first, last = [], [], []
    for c in range(v):
        s = c * p + grid.pp_rank
        first.append(s == 0)
        last.append(s == p * v - 1)
        chunks.append(build_chunk(stages[s], first[-1], last[-1], **defer))
    m = cfg.parallel.microbatches
    # The cp-local sequence crosses the wire; under SP each TP rank's share of it.
    seq = cfg.model.seq_len // cfg.parallel.cp // (cfg.parallel.tp if cfg.parallel.sp else 1)
    wire = WireFormat((seq, cfg.train.micro_batch, cfg.model.hidden), dtype, device)
    store = None
    if cfg.parallel.schedule == "zb":
        store = WeightGradStore()
        attach_weight_grad_store(chunks, store)
    actions = build_schedule(cfg.parallel.schedule, p, m, v)[grid.pp_rank]
    separator = document_separator(cfg.data.tokenizer) if cfg.data.document_mask else None
    executor = PipelineExecutor(
        StagePlan(chunks, first, last, wire, grid.pp, separator),
        actions,
        store,
        free_sent_outputs=cfg.parallel.free_sent_outputs,
    )
    return chunks, executor


def tied_head_weights(chunks: list[nn.Module], tied: bool, grid: Grid) -> list[nn.Parameter]:
    """The embedding (first stage) or its copy in the head (last stage), when the model ties
    them (`tied`, model.tie_embeddings) and the two live on different pipeline ranks."""
    if not tied or grid.layout.pp == 1:
        return []
    out = []
    for chunk in chunks:
        if chunk.tok_embed is not None:
            out.append(chunk.tok_embed.weight)
        if chunk.head is not None and chunk.tok_embed is None:
            out.append(chunk.head.weight)
    return out
