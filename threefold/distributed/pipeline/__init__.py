"""Pipeline parallelism: which layers each stage holds, and schedules as data.

A schedule is a pure function returning every rank's ordered actions (`schedules`); the
simulator runs those lists without processes to measure the bubble and prove them complete
and deadlock-free (`simulate`). One executor runs any schedule.
"""

from threefold.distributed.pipeline.schedules import (
    SCHEDULES,
    Action,
    ScheduleError,
    build_schedule,
    check_args,
    format_schedule,
    gpipe,
    group_batches,
    interleaved_1f1b,
    one_f_one_b,
    stage_owner,
    virtual_stage,
    zero_bubble_h1,
)
from threefold.distributed.pipeline.simulate import (
    DeadlockError,
    SimResult,
    Span,
    bubble_theory,
    check_schedule,
    format_timeline,
    simulate,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "ScheduleError",
    "build_schedule",
    "check_args",
    "format_schedule",
    "gpipe",
    "group_batches",
    "interleaved_1f1b",
    "one_f_one_b",
    "stage_owner",
    "virtual_stage",
    "zero_bubble_h1",
    "DeadlockError",
    "SimResult",
    "Span",
    "bubble_theory",
    "check_schedule",
    "format_timeline",
    "simulate",
]
