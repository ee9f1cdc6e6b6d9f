"""Which node holds which place of the layout in a round of an elastic job, and which wait as spares.

Under torchrun `--nnodes MIN:MAX` the rendezvous admits up to MAX nodes (one agent each) per
round and numbers them in its own order. The layout needs `nodes_needed` whole nodes: a node at
position k runs ranks k * per_node to (k + 1) * per_node - 1, and every node beyond the layout's
waits as a spare and takes no rank. `decide` carries the positions from round to round, so that
the placement holds:

    a node lost     a spare (or a node new to the job) takes its position: layout, dp and global
                    batch stay; without one the survivors close up (parallel.dp 0 shrinks)
    nodes join      they fill the positions a larger layout gains (parallel.dp 0 grows back) or
                    wait as spares
    the others      keep their positions

A round also has one attempt number for all its workers (the agents' own restart counts differ:
a spare or a returning node restarts without a failure), and one clause saying what changed,
which the restart's console line carries ("spare n2 replaced n1"). Pure: training/seats.py runs
it once per round on the launcher's rank 0 and hands each worker its seat.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from threefold.config import Config
from threefold.errors import ConfigError

ROUND_ENV = "THREEFOLD_ROUND"
"""What this worker's round says of itself ({"restarts", "failed", "change"}, JSON), set by
training/seats.py for the restart line (restart_line)."""
NAMED = 4
"""Nodes a clause names before it counts the rest."""


@dataclass(frozen=True)
class Node:
    """A node present in this round: its name (the topology's, training/seats.node_name) and its
    agent's restart count (TORCHELASTIC_RESTART_COUNT: failures that agent restarted on)."""

    name: str
    restarts: int = 0


@dataclass(frozen=True)
class Round:
    """One round of the job: who trains where, who waits, and what changed since the last one."""

    attempt: int
    """This round's number among the job's rounds, failures and membership changes alike."""
    restarts: int
    """The most restarts on failure any present agent made: the restart line's n."""
    failed: bool
    """The round follows a failure (an agent that was present before restarted its workers)."""
    seats: tuple[str, ...]
    """Node name by position."""
    spares: tuple[str, ...]
    """Present nodes that take no rank, in the order they take positions."""
    dp: int
    counts: dict[str, int] = field(default_factory=dict)
    """Each present node's agent restart count (the next round's `failed`)."""
    change: str = ""
    """One clause, what changed since the previous round ("" when nothing did)."""

    def to_json(self) -> dict:
        out = asdict(self)
        out["seats"], out["spares"] = list(self.seats), list(self.spares)
        return out

    @classmethod
    def from_json(cls, data: dict) -> Round:
        return cls(
            attempt=int(data["attempt"]),
            restarts=int(data["restarts"]),
            failed=bool(data["failed"]),
            seats=tuple(data["seats"]),
            spares=tuple(data["spares"]),
            dp=int(data["dp"]),
            counts={str(k): int(v) for k, v in data.get("counts", {}).items()},
            change=str(data.get("change", "")),
        )


def nodes_needed(cfg: Config, nodes: int, per_node: int) -> int:
    """How many of the `nodes` present (`per_node` processes each) the layout uses. An explicit
    parallel.dp needs its own count (more present: spares; fewer: validate names the shortfall);
    parallel.dp 0 takes the most nodes a valid layout fills (a dp that does not divide the global
    batch leaves the rest as spares). Spares are whole nodes: a layout that would leave part of
    one idle is refused."""
    from threefold.validate import validate

    p = cfg.parallel
    if p.dp > 0:
        ranks = p.dp * p.tp * p.pp * p.cp
        if ranks > nodes * per_node and ranks % per_node == 0:
            raise ConfigError(
                "parallel.dp",
                f"the layout's {ranks} ranks need {ranks // per_node} nodes of {per_node} processes, but the "
                f"rendezvous brought {nodes} (a node lost with no spare left?)",
                f"torchrun --nnodes {ranks // per_node}:MAX waits for a replacement; parallel.dp 0 shrinks instead",
            )
        if ranks >= nodes * per_node:
            return nodes
        if ranks % per_node:
            raise ConfigError(
                "parallel.dp",
                f"the layout's {ranks} ranks (dp*tp*pp*cp) leave part of a node of {per_node} processes idle "
                f"({nodes} nodes joined; nodes beyond the layout's wait as whole spares)",
                f"a layout of a multiple of {per_node} ranks, or parallel.dp 0",
            )
        return ranks // per_node
    for count in range(nodes, 0, -1):
        try:
            validate(Config.from_dict(cfg.to_dict()), count * per_node)
        except ConfigError:
            continue
        return count
    return nodes  # no count fits: validate says why at the full size


def host_order(path: str) -> list[str]:
    """The hosts of parallel.hostfile in seating order: one per line (# comments), or a placement
    JSON's hosts then spares (threefold plan --placement-out)."""
    if not path:
        return []
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as err:
        raise ConfigError("parallel.hostfile", f"cannot read {path}: {err.strerror}") from None
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
            return [str(h) for h in doc["hosts"]] + [str(h) for h in doc.get("spares", [])]
        except (ValueError, KeyError, TypeError):
            raise ConfigError("parallel.hostfile", f"{path} is JSON without a list of hosts") from None
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


def data_parallel(cfg: Config, used: int, per_node: int) -> int:
    p = cfg.parallel
    return p.dp if p.dp > 0 else used * per_node // max(1, p.tp * p.pp * p.cp)


def labels(names: list[str], tags: list[str], previous: Round | None) -> list[str]:
    """Each present node's label: its name, or `name:tag` where several nodes report one name
    (agents on one host; the tag tells them apart). A node keeps the label the previous round
    knew it by, so that it keeps its position when the others with its name are gone."""
    known = set(previous.seats + previous.spares) if previous is not None else set()
    out = []
    for name, tag in zip(names, tags):
        tagged = f"{name}:{tag}"
        alone = names.count(name) == 1
        out.append(tagged if tagged in known or not alone else name)
    return out


def decide(previous: Round | None, present: list[Node], needed: int, dp: int, order: list[str] = ()) -> Round:
    """The round for the nodes `present` (in rendezvous order) when the layout needs `needed`
    of them at data-parallel degree `dp`; `previous`: the job's last round (None: its first, whose
    positions follow the host `order` of a placement, parallel.hostfile, where it names them)."""
    counts = {n.name: n.restarts for n in present}
    names = [n.name for n in present]
    most = max(counts.values(), default=0)
    if previous is None:
        rank = {host: k for k, host in enumerate(order)}
        names.sort(key=lambda n: rank.get(n, rank.get(n.split(":")[0], len(rank))))  # stable: the rest as they came
        seats, spares = names[:needed], names[needed:]
        return Round(most, most, most > 0, tuple(seats), tuple(spares), dp, counts)
    was_spare = set(previous.spares)
    # Positions whose node is gone are taken by spares first, then by nodes new to the job.
    free = [n for n in previous.spares if n in counts]
    free += [n for n in names if n not in previous.seats and n not in was_spare]
    kept: list[str | None] = [s if s in counts else None for s in previous.seats]
    replaced, lost = [], []
    for position, node in enumerate(kept):
        if node is None and free and position < needed:
            kept[position] = free.pop(0)
            replaced.append((kept[position], previous.seats[position]))
        elif node is None:
            lost.append(previous.seats[position])
    seats = [s for s in kept if s is not None]  # unreplaced losses: the rest close up
    stepped_down = seats[needed:]
    seats = seats[:needed]
    joined = free[: needed - len(seats)]
    seats += joined
    spares = free[len(joined) :] + stepped_down
    parts = [f"{'spare ' if new in was_spare else ''}{new} replaced {old}" for new, old in replaced]
    parts += _named(lost, "lost") + _named([n for n in joined if n not in was_spare], "joined")
    parts += _named([n for n in joined if n in was_spare], "spare {} took a new position", each=True)
    parts += _named([n for n in spares if n not in was_spare], "waits as a spare", "wait as spares")
    parts += _named([n for n in previous.spares if n not in counts], "spare {} lost", each=True)
    if dp != previous.dp:
        parts.append(f"dp {previous.dp} -> {dp}")
    failed = any(counts[n] > previous.counts.get(n, counts[n]) for n in counts)
    attempt = max(most, previous.attempt + 1)
    return Round(attempt, most, failed, tuple(seats), tuple(spares), dp, counts, ", ".join(parts))


def _named(nodes: list[str], verb: str, plural: str | None = None, each: bool = False) -> list[str]:
    """['n1, n2 lost'] (NAMED names, then a count); with `each`, one clause per node ('{}' is it)."""
    if not nodes:
        return []
    if each:
        return [verb.format(n) for n in nodes[:NAMED]] + ([f"{len(nodes) - NAMED} more"] if len(nodes) > NAMED else [])
    shown = ", ".join(nodes[:NAMED]) + (f" and {len(nodes) - NAMED} more" if len(nodes) > NAMED else "")
    return [f"{shown} {plural if plural and len(nodes) > 1 else verb}"]


def first_line(rnd: Round) -> str:
    """The first round's line (training rank 0 prints it when some node waits as a spare)."""
    seats = ", ".join(rnd.seats[:NAMED]) + (f" and {len(rnd.seats) - NAMED} more" if len(rnd.seats) > NAMED else "")
    spares = _named(list(rnd.spares), "waits as a spare", "wait as spares")
    return f"threefold: nodes {seats} train (dp {rnd.dp}); {spares[0]}"


def round_of(environ: dict | None = None) -> dict | None:
    """This worker's round as training/seats.py left it in the environment (None: no seating)."""
    text = (os.environ if environ is None else environ).get(ROUND_ENV)
    return json.loads(text) if text else None


def restart_line(n: int, of: int, why: str | None, step: int, source: str, environ: dict | None = None) -> str:
    """The restarted attempt's one line: the failure and the recovery, and what the round changed
    (which spare replaced which node, who joined, dp). A round that follows no failure (a node
    joined) says only what changed. `n`: the attempt; `of`: the agent's restart limit."""
    rnd = round_of(environ)
    resumed = f"resumed at step {step}{source}"
    if rnd is None:
        return f"threefold: restart {n} of {of}{f' after {why}' if why else ''}; {resumed}"
    change = rnd.get("change", "")
    if not rnd.get("failed") and change:
        return f"threefold: the job re-formed: {change}; {resumed}"
    after = f" after {why}" if why else ""
    return f"threefold: restart {rnd['restarts']} of {of}{after}{f'; {change}' if change else ''}; {resumed}"
