"""Checkpoint interval and goodput under failures (Young 1974, Daly 2006).

With M the mean time between failures of the whole job (one device's MTBF / devices: any
failure stops a synchronous job), C the time to save a checkpoint and R the time from a
failure to training again (detection, restart, loading the checkpoint):

    Young:  tau = sqrt(2 C M)                                   (first order, C << M)
    Daly:   tau = sqrt(2 C M) (1 + sqrt(C/(2M))/3 + C/(18M)) - C  (C < 2M; else tau = M)
    goodput(tau) = tau / (M e^(R/M) (e^((tau + C)/M) - 1))       (Daly's expected wall time)

We recommend Young's interval, the one the formula most tools quote, and report Daly's
goodput at it; Daly's own optimum is shown next to it (they differ by well under 1% of goodput
while C << M). The formulas live in observe/failure_model.py, where the training loop's
`checkpoint.interval auto` uses them too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from threefold.config import knob
from threefold.errors import ConfigError
from threefold.observe.failure_model import daly_interval, goodput, young_interval  # noqa: F401 - the planner's API


@dataclass
class Faults:
    """Failure and recovery costs."""

    device_mtbf_h: float = knob(
        50000.0,
        "Mean hours between failures of one device with its share of host and "
        "network (Llama 3: 419 stops in 54 days on 16,384 GPUs ~ 50,000 h)",
    )
    checkpoint_s: float = knob(
        0.0, "Seconds one checkpoint save stalls training (0 = estimate from the state size and storage_bw_gbps)"
    )
    restart_s: float = knob(
        600.0, "Seconds from a failure to training again with a node to run on: detect, restart, reload"
    )
    storage_bw_gbps: float = knob(2.0, "Checkpoint write bandwidth per node in GB/s, for the save-time estimate")
    reschedule_s: float = knob(
        1800.0,
        "Seconds a failure costs beyond restart_s when no spare node can take the failed one's place: "
        "the scheduler drains it and allocates a replacement (plan --spares; a prior, set it from your cluster)",
    )
    node_repair_h: float = knob(24.0, "Hours a failed node is out before it serves again (plan --spares; a prior)")


FIELDS = {name: f for name, f in Faults.__dataclass_fields__.items()}


def build_faults(overrides: list[tuple[str, str]]) -> Faults:
    f = Faults()
    for key, raw in overrides:
        if key not in FIELDS:
            raise ConfigError(f"faults.{key}", "unknown key", "valid: " + ", ".join(f"faults.{k}" for k in FIELDS))
        try:
            setattr(f, key, float(raw))
        except ValueError:
            raise ConfigError(f"faults.{key}", f"{raw!r} is not a number") from None
    if f.device_mtbf_h <= 0:
        raise ConfigError("faults.device_mtbf_h", f"must be > 0, got {f.device_mtbf_h}")
    for key in ("checkpoint_s", "restart_s", "reschedule_s", "node_repair_h"):
        if getattr(f, key) < 0:
            raise ConfigError(f"faults.{key}", f"must be >= 0, got {getattr(f, key)}")
    if f.storage_bw_gbps <= 0:
        raise ConfigError("faults.storage_bw_gbps", f"must be > 0, got {f.storage_bw_gbps}")
    return f


def no_spare_probability(spares: int, nodes: int, node_mtbf_h: float, repair_h: float) -> float:
    """P(every spare is already standing in when a node fails). Nodes out for repair at a time
    are Poisson with mean nodes x repair_h / node_mtbf_h (failures at rate nodes / MTBF, each out
    for repair_h); a failure finds a spare unless `spares` or more are out."""
    mean = nodes * repair_h / node_mtbf_h
    return max(0.0, 1.0 - sum(math.exp(-mean) * mean**i / math.factorial(i) for i in range(spares)))


def recovery_s(faults: Faults, spares: int, nodes: int, gpus_per_node: int) -> float:
    """Expected seconds from a failure to training again with `spares` hot spares: the restart,
    and the reschedule when no spare is free."""
    node_mtbf_h = faults.device_mtbf_h / gpus_per_node
    return (
        faults.restart_s + no_spare_probability(spares, nodes, node_mtbf_h, faults.node_repair_h) * faults.reschedule_s
    )


@dataclass
class FaultAdvice:
    devices: int
    system_mtbf_s: float
    checkpoint_s: float
    checkpoint_bytes: float
    restart_s: float
    interval_s: float
    interval_steps: int
    daly_interval_s: float
    goodput: float
    daly_goodput: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def sentence(self) -> str:
        return (
            f"{self.devices} devices fail every {self.system_mtbf_s / 3600:.2f} h on average; a checkpoint takes "
            f"{self.checkpoint_s:.1f} s and a restart {self.restart_s:.0f} s: checkpoint every "
            f"{self.interval_s / 60:.1f} min (~{self.interval_steps} steps, Young); expected goodput "
            f"{self.goodput:.1%} (Daly's optimum {self.daly_interval_s / 60:.1f} min: {self.daly_goodput:.1%})."
        )


def advise(
    faults: Faults,
    devices: int,
    nodes: int,
    total_params: float,
    step_time_s: float,
    dtype: str = "bf16",
    restart_s: float | None = None,
) -> FaultAdvice:
    """Checkpoint interval and goodput for a job of `devices` devices on `nodes` nodes (a failure
    costing `restart_s`, faults.restart_s unless given: recovery_s with spares)."""
    restart = faults.restart_s if restart_s is None else restart_s
    mtbf = faults.device_mtbf_h * 3600 / devices
    # A checkpoint holds parameters and optimizer state (master weights + moments), not gradients.
    per_param = 2 + 12 if dtype == "bf16" else 4 + 8
    nbytes = total_params * per_param
    save = faults.checkpoint_s or nbytes / (faults.storage_bw_gbps * 1e9 * nodes)
    tau = young_interval(save, mtbf)
    daly = daly_interval(save, mtbf)
    return FaultAdvice(
        devices=devices,
        system_mtbf_s=mtbf,
        checkpoint_s=save,
        checkpoint_bytes=nbytes,
        restart_s=restart,
        interval_s=tau,
        interval_steps=max(1, round(tau / step_time_s)) if step_time_s > 0 else 1,
        daly_interval_s=daly,
        goodput=goodput(tau, save, restart, mtbf),
        daly_goodput=goodput(daly, save, restart, mtbf),
    )
