"""One layout's prediction: memory (planner/memory.py) and the step time of planner/cost.py,
turned into what the planner reports (tokens/s, MFU, HFU, bubble, the slowest rank)."""

from __future__ import annotations

from dataclasses import dataclass

from threefold.planner.cluster import Cluster
from threefold.planner.cost import step_terms
from threefold.planner.layout import Layout
from threefold.planner.memory import Memory, device_memory
from threefold.planner.model import ModelShape


@dataclass
class Prediction:
    """Everything the planner says about one layout."""

    layout: Layout
    microbatches: int
    memory: Memory
    usable_bytes: float
    times: dict[str, float]
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_device: float
    mfu: float
    hfu: float
    bubble_fraction: float
    slowest_rank: str
    links: dict[str, str]
    devices_used: int

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    def as_dict(self) -> dict:
        out = self.layout.as_dict()
        out.update(
            microbatches=self.microbatches,
            memory_bytes_per_device=self.memory.total,
            memory=self.memory.as_dict(),
            usable_bytes_per_device=self.usable_bytes,
            fits=self.fits,
            step_time_s=self.step_time_s,
            tokens_per_s=self.tokens_per_s,
            model_tflops_per_device=self.model_tflops_per_device,
            mfu=self.mfu,
            hfu=self.hfu,
            bubble_fraction=self.bubble_fraction,
            time_split_s=dict(self.times),
            time_split_fraction={k: v / self.step_time_s for k, v in self.times.items()},
            slowest_pipeline_rank=self.slowest_rank,
            links=dict(self.links),
            devices_used=self.devices_used,
        )
        return out


def predict(
    shape: ModelShape,
    cluster: Cluster,
    layout: Layout,
    global_batch: int,
    dtype: str = "bf16",
    memory: Memory | None = None,
) -> Prediction:
    """Memory and step time of `layout` (assumed structurally valid: see layout.structural_reason)."""
    memory = memory or device_memory(shape, layout, global_batch, dtype)
    terms = step_terms(shape, cluster, layout, global_batch, dtype)
    times = terms.times(cluster)
    step = sum(times.values())
    tokens = global_batch * shape.seq_len
    world = layout.world
    model_flops = shape.model_flops_per_token * tokens
    peak = cluster.peak_tflops * 1e12
    return Prediction(
        layout=layout,
        microbatches=layout.microbatches(global_batch),
        memory=memory,
        usable_bytes=cluster.usable_bytes,
        times=times,
        step_time_s=step,
        tokens_per_s=tokens / step,
        model_tflops_per_device=model_flops / step / world / 1e12,
        mfu=model_flops / (step * world * peak),
        hfu=shape.hardware_flops_per_step(global_batch, layout.recompute) / (step * world * peak),
        bubble_fraction=times["bubble"] / step,
        slowest_rank=terms.slowest_rank,
        links=terms.links,
        devices_used=world,
    )
