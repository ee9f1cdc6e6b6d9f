"""Bytes and calls per group for one tp2 x pp2 x dp2 ZeRO 1 step, as spans.jsonl reports them,
against the count the layout implies (the convention of comm.CommStats: bytes = the whole
logical tensor of a collective, a send's payload; receives are not counted again)."""

import json
from types import SimpleNamespace

import pytest
import torch

from threefold.config import build_config
from threefold.distributed.comm import Group
from threefold.distributed.data_parallel.engine import MiB, _ordered_params
from threefold.distributed.data_parallel.layout import build_layout
from threefold.distributed.pipeline.partition import stage_layer_ids
from threefold.distributed.tensor_parallel import apply_tensor_parallel
from threefold.distributed.tp_collectives import DENSE_BLOCK, LOSS_FP32_PER_TOKEN, TP_COLLECTIVES, block_collectives
from threefold.model.transformer import Transformer

from harness import CALM_LR, run_training

SEQ, B, MB, TP, PP, DP = 32, 8, 2, 2, 2, 2
RUN = {
    "train.steps": 3,
    "train.seed": 0,
    "train.lr": CALM_LR,
    "model.seq_len": SEQ,
    "train.global_batch": B,
    "train.micro_batch": MB,
    "parallel.tp": TP,
    "parallel.pp": PP,
    "parallel.dp": DP,
    "parallel.zero": 1,
    "log.spans": "true",
    "log.interval": 1,  # a spans.jsonl line per step
    "checkpoint.dir": "",  # the step's traffic only, not a save's metadata round at the end
}


def padded_numel(cfg, stage: int) -> tuple[int, int]:
    """(gradient buffer elements, buckets) of a stage's tensor-parallel shard, laid out as the
    data-parallel engine lays it out for ZeRO 1 over dp."""
    ids = stage_layer_ids(cfg.model, PP, 1, "")[stage]
    with torch.device("meta"):
        chunk = Transformer(cfg.model, layer_ids=ids, first=stage == 0, last=stage == PP - 1)
        apply_tensor_parallel(chunk, SimpleNamespace(tp=Group("tp", list(range(TP)), None)), False)
    params, _, _ = _ordered_params([chunk], 1, set())
    layout = build_layout([tuple(p.shape) for p in params], cfg.parallel.bucket_mb * MiB, 4, DP)
    return layout.numel, len(layout.buckets)


def expected(cfg, stage: int) -> dict[str, tuple[int, int]]:
    """group -> (calls, bytes) of one step on a rank of `stage` (fp32, llama: kv heads split
    over tp, no SP, no tied embedding, no experts)."""
    m = cfg.model
    micro = B // (DP * MB)
    x = SEQ * MB * m.hidden * 4  # one activation [seq, micro-batch, hidden]
    layers = len(stage_layer_ids(m, PP, 1, "")[stage])
    # TP per micro-batch, as distributed/tp_collectives.py counts it without SP: each layer's
    # attention and MLP, the embedding (first stage) or the head (last), each collective one x;
    # the vocab-parallel loss (last): a max and the target-logit/exp sums, fp32 per token.
    # Once per step: the squared norms of the TP shards, one fp32 scalar.
    table = TP_COLLECTIVES[False]
    end = table["embedding"] if stage == 0 else table["head"]
    activations = layers * block_collectives(False, DENSE_BLOCK).calls + end.both.calls
    tp_calls = micro * activations + 1
    tp_bytes = micro * activations * x + 4
    if stage == PP - 1:
        tp_calls += micro * table["loss"].both.calls
        tp_bytes += micro * LOSS_FP32_PER_TOKEN * SEQ * MB * 4
    # PP: one send per micro-batch (activations forward, or their gradients backward); the
    # spans' pipeline flush (1 float) and the norm's sum over stages, the loss riding it (2 fp64).
    pp = (micro + 2, micro * x + 4 + 16)
    # DP, ZeRO 1: each bucket's gradients reduce-scattered into this rank's slice and its
    # updated parameters all-gathered (each the padded buffer), and the norm's squared sum over
    # the slices with the step's loss beside it (2 fp64).
    numel, buckets = padded_numel(cfg, stage)
    dp = (2 * buckets + 1, 2 * numel * 4 + 16)
    # World: the control plane's MAX of 8 fp64 (two non-finite flags, memory, data wait, pipeline
    # wait and idle, compute time, a stop signal), whatever the world size (the loss rode the
    # norm's sums); every step here is a report step (log.interval 1): each rank's compute time
    # (fp64) gathered to rank 0, which handles all eight (see rank_0_world).
    world = (2, 8 * 8 + 8)
    return {"tp": (tp_calls, tp_bytes), "pp": pp, "dp": dp, "ep": (0, 0), "world": world}


@pytest.fixture(scope="module")
def spans(tmp_path_factory, cache_dir) -> list[dict]:
    root = tmp_path_factory.mktemp("volume")
    run_training(RUN, root, cache_dir)
    return [json.loads(line) for line in (root / "spans.jsonl").read_text().splitlines()]


def test_every_group_carries_what_the_layout_implies(spans):
    cfg = build_config(None, [(k, str(v)) for k, v in RUN.items()])
    want = {stage: expected(cfg, stage) for stage in range(PP)}
    assert [s["step"] for s in spans] == [1, 2, 3]
    for record in spans:
        assert len(record["ranks"]) == TP * PP * DP
        for rank in record["ranks"]:
            got = {g: (rank["comm_calls"][g], rank["comm_bytes"][g]) for g in ("tp", "pp", "dp", "ep", "world")}
            world = TP * PP * DP
            rank_0_world = {"world": (2, 8 * 8 + 8 * world)} if rank["rank"] == 0 else {}
            assert got == {**want[rank["pp"]], **rank_0_world}, (record["step"], rank["rank"])
