"""PLACEHOLDER (helper H5 replaces this file): train.on_slow's actions."""


class LeaveRun(Exception):
    """Raised on every rank when an action ends this attempt (exclude, rebalance)."""


class Actions:
    def __init__(self, cfg, grid, is_logger: bool, log=print):
        pass

    def after_step(self, step: int, record: dict, diagnosis, report: bool) -> None:
        """Every rank, every step after the diagnosis; collective over the world only on report
        steps (rank 0 decides, one broadcast); raises LeaveRun on every rank to act."""


def end_attempt(cfg, grid, env, err: LeaveRun) -> None:
    """In the worker: how an attempt that an action ended leaves (exits)."""
    raise SystemExit(1)


def planned_config(cfg, env):
    """In the worker, before the layout: the config with a pending rebalance applied."""
    return cfg
