"""`threefold tune`: measured trials of the most promising layouts until the best is found.

    threefold tune --model.preset small --train.global_batch 32 --nproc 4 \\
        --space microbatches=2,4,8 --space schedule=1f1b,interleaved --space zero=0,1 --trials 9

The model and every fixed setting come from --config and --section.key as for `threefold train`;
--space lists the values a knob may take (dp, tp, pp: allowed degrees; by default every
(dp, tp, pp) whose product is --nproc). Trials run here, one after the other, each through
`threefold train` on --nproc processes.
"""

from __future__ import annotations

import argparse

from threefold.errors import ConfigError

USAGE = """threefold tune [--config FILE] [--section.key VALUE ...] --nproc N
                      [--space KEY=V1,V2 ...] [--trials N] [--minutes M] [--steps S]
                      [--out DIR] [--cache DIR|none] [--cluster.KEY VALUE ...]"""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="threefold tune", usage=USAGE)
    ap.add_argument("--config", help="TOML file with the model and the fixed settings")
    ap.add_argument("--nproc", type=int, default=0, help="processes per trial (default: the config's dp*tp*pp)")
    ap.add_argument("--space", action="append", default=[], help="KEY=V1,V2: values a knob may take (repeatable)")
    ap.add_argument("--trials", type=int, default=0, help="most new trials (default: a quarter of the candidates)")
    ap.add_argument("--minutes", type=float, default=0.0, help="wall-clock budget (default: none)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per trial")
    ap.add_argument("--trial-timeout", type=float, default=900.0, help="seconds before a trial counts as failed")
    ap.add_argument("--out", default="runs/tune", help="directory for best.toml, journal.jsonl, report.html")
    ap.add_argument("--cache", default="", help="cache directory (default ~/.cache/threefold/tune; none: off)")
    return ap


def tune_command(argv: list[str]) -> int:
    from threefold.api import configure
    from threefold.planner.cluster import split_cluster_args
    from threefold.planner.tune.loop import TuneOptions, Tuner
    from threefold.planner.tune.output import format_summary, write_outputs
    from threefold.planner.tune.space import Space

    argv, cluster_pairs = split_cluster_args(argv)
    args, config_args = _parser().parse_known_args(argv)
    cfg = configure(args.config, config_args)
    p = cfg.parallel
    world = args.nproc or max(1, p.dp) * p.tp * p.pp * p.cp
    if world < 1:
        raise ConfigError("--nproc", f"{world} processes", "give a positive number")
    for name, value in (("--trials", args.trials), ("--steps", args.steps - 1), ("--minutes", args.minutes)):
        if value < 0:
            raise ConfigError(name, f"{value} is negative" if name != "--steps" else "a trial needs at least 2 steps")
    space = Space.parse(cfg, world, args.space)
    options = TuneOptions(
        out=args.out,
        trials=args.trials,
        minutes=args.minutes,
        steps=args.steps,
        trial_timeout_s=args.trial_timeout,
        cache=args.cache,
        cluster_pairs=cluster_pairs,
    )
    print(
        f"tune: {len(space.candidates)} candidates on {world} processes "
        f"({space.nominal} in the plain product, {len(space.refused)} refused by a rule)"
    )
    result = Tuner(cfg, world, space, options).run()
    from pathlib import Path

    summary = write_outputs(result, cfg, Path(args.out))
    print(format_summary(summary))
    print(f"journal: {Path(args.out) / 'journal.jsonl'}; report: {Path(args.out) / 'report.html'}")
    return 0 if result.best is not None else 1
