"""`threefold train`: validate, prepare shared state once, then run the workers."""

from __future__ import annotations

from threefold.config import Config
from threefold.distributed.runtime import under_launcher
from threefold.validate import validate


def _prepare_once(cfg: Config) -> None:
    """Work that every worker would repeat: tokenize the corpus into the cache, measure the CPU peak.
    Done before spawning so workers only memory-map the cache and read the cached peak."""
    import torch

    from threefold.observe import device_peak_flops
    from threefold.training.trainer import open_data, resolve_dtype

    open_data(cfg)
    device = torch.device("cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        device_peak_flops(
            device, resolve_dtype(cfg.train.dtype, device), threads=cfg.train.threads, cache_dir=cfg.data.cache_dir
        )


def start_workers(cfg: Config, measure_memory: bool = False, callbacks=None):
    """Validate, prepare shared state once, run the workers; returns rank 0's result.
    Raises WorkersFailed when a worker failed (it has printed its own reason)."""
    from threefold.training.faults import check as check_faults
    from threefold.training.worker import run_worker

    if under_launcher():
        # Started by torchrun (multi-node, Slurm): this process is one worker, seated in the
        # round first (training/seats.py): a node beyond the layout's waits as a spare.
        from threefold.training.seats import release, take_seat, wait_as_spare

        seat = take_seat(cfg)
        if seat.spare:
            wait_as_spare(seat, cfg)
            return None
        validate(cfg, world_size=seat.world)
        check_faults(cfg.train, seat.world, seat.attempt)
        try:
            result = run_worker(cfg.to_dict(), measure_memory, callbacks, store=seat.store)
        except BaseException:
            release(seat, ok=False)
            raise
        release(seat, ok=True)
        return result
    validate(cfg)
    if cfg.train.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            from threefold.errors import ConfigError

            raise ConfigError("train.device", "cuda was asked for but no CUDA device is visible", "valid: auto, cpu")
    world = cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    check_faults(cfg.train, world)
    _prepare_once(cfg)
    if world == 1 and cfg.train.max_restarts == 0:
        return run_worker(cfg.to_dict(), measure_memory, callbacks)
    from threefold.distributed.launch import launch

    return launch(
        run_worker,
        (cfg.to_dict(), measure_memory, callbacks),
        world,
        cfg.train.threads,
        cfg.train.max_restarts,
        cfg.train.timeout_s,
        log_dir=cfg.log.dir,
        grace_s=cfg.train.preempt_grace_s,
    )
