"""`threefold tune`: plan -> a short measured trial -> recalibrate -> the next trial by expected
improvement -> stop at the budget or when nothing is predicted to beat the best beyond noise.

    space = Space.parse(cfg, world, ["microbatches=2,4,8", "schedule=1f1b,interleaved", "zero=0,1"])
    result = Tuner(cfg, world, space, TuneOptions(out="runs/tune", trials=9)).run()

space.py enumerates the candidates with the planner's and the trainer's rules; trials.py runs one
through `threefold train`; surrogate.py is the calibrated planner plus a Gaussian process over its
residuals (expected improvement, the stop rule); cache.py keeps measured trials keyed by model,
cluster and versions; output.py writes the best TOML, the journal, bands and the report page.
"""

from threefold.planner.tune.loop import TuneOptions, Tuner, TuneResult
from threefold.planner.tune.space import Candidate, Space

__all__ = ["Candidate", "Space", "TuneOptions", "TuneResult", "Tuner"]
