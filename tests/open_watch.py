"""Count the files a subprocess run opens for reading under a directory, in every process it starts
(the elastic agent's workers too): a sitecustomize.py on PYTHONPATH installs an audit hook that
appends each such open, with the worker's attempt, to a log.

    env = watch_opens(tmp_path, ckpt_dir, env)      # before starting the command
    opens = opened(tmp_path)                        # [(attempt, path), ...] afterwards
"""

from __future__ import annotations

import os
from pathlib import Path

HOOK = """
import os, sys

_root, _log = os.environ.get("OPEN_WATCH_ROOT"), os.environ.get("OPEN_WATCH_LOG")


def _hook(event, args):
    if event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.path.abspath(os.fsdecode(args[0]))
    mode = args[1] if len(args) > 1 else None
    flags = args[2] if len(args) > 2 else 0
    writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR))
    if path.startswith(_root) and not writes:
        line = os.environ.get("TORCHELASTIC_RESTART_COUNT", "-") + " " + path + "\\n"
        fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # not audited as "open"
        os.write(fd, line.encode())
        os.close(fd)


if _root and _log:
    sys.addaudithook(_hook)
"""


def watch_opens(tmp_path: Path, root: Path, env: dict) -> dict:
    hook = tmp_path / "open_watch"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(p for p in (str(hook), env.get("PYTHONPATH", "")) if p)
    watched = {"OPEN_WATCH_ROOT": str(Path(root).resolve()), "OPEN_WATCH_LOG": str(hook / "log")}
    return {**env, "PYTHONPATH": path, **watched}


def opened(tmp_path: Path) -> list[tuple[str, str]]:
    log = tmp_path / "open_watch" / "log"
    if not log.exists():
        return []
    return [tuple(line.split(" ", 1)) for line in log.read_text().splitlines()]
