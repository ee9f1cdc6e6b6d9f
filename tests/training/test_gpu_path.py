"""The GPU performance path, checked on CPU: the chunked loss, the device timer (with fake CUDA
events), the device a local rank picks, pinned prefetched batches, fp32 gradients by default
and the presets' optimizer schedules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from host_reads import FakeCudaEvent

from threefold.config import build_config
from threefold.data.prefetch import Prefetcher, pinned
from threefold.distributed import runtime
from threefold.distributed import timer as timer_mod
from threefold.distributed.data_parallel import MixedPrecision
from threefold.distributed.timer import DeviceTimer
from threefold.errors import ConfigError
from threefold.model.loss import chunked_cross_entropy_sum

# ----------------------------------------------------------------------------- chunked loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, None])
def test_chunked_loss_equals_the_unchunked_loss_and_gradient(dtype, rows):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, 6, 97, generator=gen) * 4).to(dtype)  # [seq, batch, vocab]
    targets = torch.randint(0, 97, (8, 6), generator=gen)
    ref_in, got_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.float().flatten(0, 1), targets.flatten(), reduction="sum")
    got = chunked_cross_entropy_sum(got_in, targets, rows)
    (ref * 0.7).backward()
    (got * 0.7).backward()
    assert got.dtype == torch.float32 and got_in.grad.dtype == dtype
    assert abs(got.item() - ref.item()) <= 1e-6 * ref.item()  # summation order only
    if dtype == torch.float32:
        assert (got_in.grad - ref_in.grad).abs().max().item() <= 1e-6
    else:  # the same fp32 gradient, rounded to bf16 once: bit for bit
        assert torch.equal(got_in.grad, ref_in.grad)


def test_chunked_loss_saves_the_logits_in_their_own_dtype():
    """What backward keeps: the bf16 logits and a few numbers per token, never fp32 logits."""
    n, vocab = 64, 200
    logits = torch.randn(n, vocab).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (n,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunked_cross_entropy_sum(logits, targets, rows=16)
    big = [t for t in saved if t.numel() >= n * vocab]
    assert big and all(t.dtype == torch.bfloat16 for t in big)
    assert sum(t.numel() * t.element_size() for t in saved) < n * vocab * 2 + 32 * n


# ----------------------------------------------------------------------------- device timer


def test_device_timer_on_cpu_sums_host_intervals():
    t = DeviceTimer("cpu")
    for _ in range(3):
        with t:
            sum(range(10_000))
    assert 0 < t.seconds < 1.0
    first = t.seconds
    assert t.seconds == first  # reading does not change it
    t.reset()
    assert t.seconds == 0.0


def test_device_timer_on_cuda_resolves_event_pairs_once_when_read(monkeypatch):
    monkeypatch.setattr(timer_mod.torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(timer_mod.time, "perf_counter", lambda: pytest.fail("host clock used on cuda"))
    FakeCudaEvent.syncs, FakeCudaEvent.clock = 0, 0.0
    t = DeviceTimer(torch.device("cuda", 0))
    for width in (0.25, 0.5):
        token = t.start()
        FakeCudaEvent.clock += width  # the device's time passes; the host's is irrelevant
        t.stop(token)
        FakeCudaEvent.clock += 10.0  # gaps between intervals do not count
    assert FakeCudaEvent.syncs == 0  # nothing waits while intervals are recorded
    assert t.seconds == pytest.approx(0.75)
    syncs = FakeCudaEvent.syncs
    assert syncs >= 1  # the read waited for the device to reach the events
    assert t.seconds == pytest.approx(0.75) and FakeCudaEvent.syncs == syncs  # resolved once


def test_pipeline_stats_read_their_timers():
    from threefold.distributed.pipeline.executor import PipelineStats

    stats = PipelineStats("cpu")
    stats.wall.add(2.0)
    stats.recv_wait.add(0.5)
    stats.compute["B"].add(1.0)
    assert stats.wall_s == 2.0 and stats.recv_wait_s == 0.5 and stats.idle_fraction == 0.25
    assert stats.compute_s == {"F": 0.0, "B": 1.0, "W": 0.0}


# ----------------------------------------------------------------------------- device choice


@pytest.mark.parametrize(("count", "local_rank", "index"), [(8, 5, 5), (1, 5, 0), (4, 6, 2)])
def test_local_rank_picks_a_visible_gpu_modulo_their_number(monkeypatch, count, local_rank, index):
    chosen = []
    monkeypatch.setattr(runtime.torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(runtime.torch.cuda, "set_device", chosen.append)
    assert runtime.resolve_device("cuda", local_rank) == torch.device("cuda", index)
    assert chosen == [index]


def test_cuda_without_a_visible_gpu_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(runtime.torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="train.device"):
        runtime.resolve_device("cuda", 0)


# ----------------------------------------------------------------------------- pinned batches


def _fake_pinning(monkeypatch) -> list:
    pins = []

    def pin_memory(self):
        pins.append(self.shape)
        out = self.clone()
        out.fake_pinned = True
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: getattr(self, "fake_pinned", False))
    return pins


@pytest.mark.parametrize("depth", [0, 2])
def test_batches_for_a_cuda_device_are_pinned(monkeypatch, depth):
    pins = _fake_pinning(monkeypatch)

    def produce(step):
        return [(torch.full((2, 3), step), torch.full((2, 3), -step))]

    with Prefetcher(produce, 0, 2, depth=depth, device=torch.device("cuda", 0)) as pf:
        for step in range(2):
            [(x, y)], _ = pf.get(step)
            assert x.is_pinned() and y.is_pinned() and x[0, 0].item() == step
    assert len(pins) == 4
    with Prefetcher(produce, 0, 2, depth=depth, device="cpu") as pf:  # CPU runs copy nothing
        [(x, _)], _ = pf.get(0)
        assert not x.is_pinned()
    assert len(pins) == 4


def test_pinned_keeps_structure_and_skips_pinned_tensors(monkeypatch):
    pins = _fake_pinning(monkeypatch)
    item = {"a": [torch.zeros(1), (torch.ones(2), 3)], "b": "text"}
    out = pinned(item)
    assert out["b"] == "text" and out["a"][1][1] == 3 and isinstance(out["a"][1], tuple)
    assert len(pins) == 2 and pinned(out["a"][0]) is out["a"][0] and len(pins) == 2


# ----------------------------------------------------------------------------- precision, presets


def test_gradients_accumulate_in_fp32_by_default():
    for dtype in ("bf16", "fp16", "fp32"):
        assert MixedPrecision.from_names(dtype, "auto", "dynamic").grad_dtype == torch.float32
    assert MixedPrecision.from_names("bf16", "bf16").grad_dtype == torch.bfloat16
    assert MixedPrecision(torch.bfloat16).grad_dtype == torch.float32


def test_presets_carry_their_papers_learning_rates():
    def train(preset, *pairs):
        return build_config(None, [("model.preset", preset), *pairs]).train

    gpt = train("gpt-1.3b", ("train.global_batch", "512"))  # 512 x 2048 = 1M tokens per step
    assert (gpt.lr, gpt.min_lr_ratio, gpt.warmup_steps) == (2.0e-4, 0.1, 358)  # 375M tokens
    assert train("gpt-175b").lr == 0.6e-4
    llama = train("llama-70b")
    assert (llama.lr, llama.min_lr_ratio, llama.warmup_steps) == (1.5e-4, 0.1, 2000)
    assert train("llama-7b").lr == 3.0e-4
    mine = train("llama-7b", ("train.lr", "1e-3"), ("train.warmup_steps", "5"))  # the user's values win
    assert (mine.lr, mine.warmup_steps) == (1e-3, 5)
    assert train("tiny").lr == 3e-3 and train("tiny").warmup_steps == 20  # the defaults


def test_inductor_on_cpu_without_a_compiler_is_one_clear_error(monkeypatch):
    import shutil

    from threefold.validate import validate

    def cfg(*pairs):
        return build_config(None, [("train.device", "cpu"), ("train.compile", "true"), *pairs])

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="train.compile.*C\\+\\+ compiler"):
        validate(cfg(), 1)
    validate(cfg(("train.compile_backend", "aot_eager")), 1)  # tracing alone needs no compiler
