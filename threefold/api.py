"""The Python API: the engine `threefold train` runs, callable from your own script.

    import threefold
    cfg = threefold.configure({"model": {"preset": "tiny"}, "parallel": {"dp": 2}}, ["--train.steps", "20"])
    last = threefold.train(cfg, model=mymodel.build, callbacks=threefold.Callbacks(on_metrics=print))

`configure` applies what the command line does (TOML/dict values, then overrides, then the preset's
shape and schedule for the keys left unset); `train` validates, prepares the data once and runs
the workers (in this process for one rank, under the elastic launcher for several), returning
rank 0's last metrics record. The CLI's `threefold train` is a user of these two functions.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from threefold.config import Config, build_config, parse_overrides, set_key
from threefold.errors import ConfigError


def configure(source: Config | Mapping | str | Path | None = None, overrides: Iterable | Mapping = ()) -> Config:
    """A Config from `source` (a TOML file's path, or a dict of {section: {key: value}} tables,
    or an existing Config, copied) and `overrides` (CLI-style ["--section.key", "value", ...],
    or {"section.key": value}), the preset filling every shape and schedule key left unset."""
    if isinstance(source, Config):
        cfg = copy.deepcopy(source)
        for key, value in _pairs(overrides):
            set_key(cfg, key, value)
        return cfg
    pairs: list[tuple[str, object]] = []
    file = None
    if isinstance(source, (str, Path)):
        file = str(source)
    elif isinstance(source, Mapping):
        for section, values in source.items():
            if not isinstance(values, Mapping):
                raise ConfigError(str(section), "a config dict holds {section: {key: value}} tables")
            pairs += [(f"{section}.{key}", value) for key, value in values.items()]
    elif source is not None:
        raise ConfigError("config", f"{type(source).__name__} is not a config source", "a TOML path, dict or Config")
    return build_config(file, pairs + _pairs(overrides))


def _pairs(overrides: Iterable | Mapping) -> list[tuple[str, object]]:
    if isinstance(overrides, Mapping):
        return [(str(k).lstrip("-"), v) for k, v in overrides.items()]
    return list(parse_overrides([str(a) for a in overrides]))


def train(
    cfg: Config | Mapping | str | Path,
    model: Callable | str | None = None,
    callbacks=None,
) -> dict:
    """Run training as `threefold train` does; returns rank 0's last metrics record. `model`: a
    user model's build function (cfg.model -> threefold.ModelSpec) or its "module:function"
    name; it becomes model.arch, so every worker imports it by name (define it at module level;
    a script's own function is imported from the script's path). `callbacks`: a
    threefold.Callbacks; with several ranks they run inside the workers (rank 0 for metrics and
    checkpoints), so they must be picklable module-level functions. Raises UserError for bad
    input (one line), WorkersFailed when a worker failed."""
    from threefold.model.custom import arch_of
    from threefold.training.entry import start_workers

    cfg = configure(cfg)
    if model is not None:
        cfg.model.arch = arch_of(model)
    if callbacks is None:
        return start_workers(cfg)
    return start_workers(cfg, callbacks=callbacks)
