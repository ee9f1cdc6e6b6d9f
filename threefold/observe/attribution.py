"""What moved between two report windows: the rank, category, group or link a change is named by.

    moved = attribute(before, after)   # two observe/diagnose.py ReportViews
    moved["text"]                      # "other on rank 1 (dp 1) (+46 ms a step); its peers wait in optimizer"

Every rank's seconds per category in one report window against another's (observe/changepoint.py:
the window before a change's date against the window that confirmed it). A rank whose own work
(spans.OWN) grew by half the step's growth more than its peers' did is the cause: its own category
that grew most, and the peers' wait ("other on rank 1 ...; its peers wait in optimizer").
Otherwise the category that grew most on the median rank, its group, and the rank where it grew
most with, from the rows' `links` (observe/links.py), the group or pipeline peer whose time grew
most there.

`concentrated` tells a change from a step slower alike everywhere (another job's load on a shared
host, a slower clock on every device), where nothing in where the time goes moved.
O(world) per call: rank 0, on report steps only.
"""

from __future__ import annotations

import statistics

from threefold.observe.spans import CATEGORIES, OWN

WAIT_DIM = {"tp_comm": "tp", "cp_comm": "cp", "pp_p2p": "pp", "pp_bubble": "pp", "dp_exposed": "dp", "ep_a2a": "ep"}
"""The group dimension whose communication each waiting category times."""


def median(values) -> float:
    """The median, 0.0 of nothing."""
    values = list(values)
    return statistics.median(values) if values else 0.0


def attribution(before, after) -> dict:
    """attribute(before, after), or {} when either report view is missing."""
    return attribute(before, after) if before is not None and after is not None else {}


def _moved_link(rank: int, new: dict, old: dict) -> str:
    """The group or pipeline peer whose communication time grew most on `rank`, from the rows'
    `links` (observe/links.py's links_of); '' without them or when none grew."""
    a, b = new.get("links") or {}, old.get("links") or {}
    grown = {
        f"{g} collectives": v - b.get("collective_s", {}).get(g, 0.0) for g, v in (a.get("collective_s") or {}).items()
    }
    for side, (src, dst) in (("pp_prev", (a.get("pp_prev"), rank)), ("pp_next", (rank, a.get("pp_next")))):
        if a.get(side) is not None:
            grown[f"link pp rank {src} -> {dst}"] = a.get(f"{side}_s", 0.0) - b.get(f"{side}_s", 0.0)
    best = max(grown, key=grown.get, default="")
    return best if best and grown[best] > 0 else ""


def _where(rank: int, layout) -> str:
    """A rank with its coordinates in the dimensions the layout has ("rank 5 (tp 1, pp 1)")."""
    if layout is None:
        return f"rank {rank}"
    coords = layout.coords(rank)
    parts = [f"{d} {coords[d]}" for d in ("tp", "cp", "pp", "dp") if getattr(layout, d, 1) > 1]
    return f"rank {rank} ({', '.join(parts)})" if parts else f"rank {rank}"


def attribute(before, after) -> dict:
    """What moved between two report views (observe/diagnose.py's ReportView), from every rank's
    seconds per category per step: {"category", "rank", "text", "moved_s", "concentrated", and
    "wait" (the peers' waiting category) or "group" (the dimension of a moved wait)}; {} when they
    share no rank. `concentrated`: one rank's own work, or one category beyond its share of the
    step before, took at least half the growth; False for a step that grew alike everywhere (a
    busier host or a slower clock on every device: where the time goes did not change)."""
    old = {row["rank"]: row for row in before.ranks}
    pairs = [(row, old[row["rank"]]) for row in after.ranks if row["rank"] in old]
    if not pairs:
        return {}
    layout = getattr(after, "layout", None)
    delta = {
        new["rank"]: {c: new["time_s"].get(c, 0.0) - was["time_s"].get(c, 0.0) for c in CATEGORIES}
        for new, was in pairs
    }
    rows = {new["rank"]: (new, was) for new, was in pairs}
    grown = median(new.get("wall_s", 0.0) - was.get("wall_s", 0.0) for new, was in pairs)
    own = {rank: sum(d[c] for c in OWN) for rank, d in delta.items()}
    top = max(own, key=own.get)
    peers = [d for rank, d in delta.items() if rank != top]
    waits = [c for c in CATEGORIES if c not in OWN]
    if grown > 0 and own[top] - median(own[r] for r in own if r != top) >= 0.5 * grown:
        # One rank's own work grew: it is the cause, the others only wait for it.
        category = max(OWN, key=lambda c: delta[top][c])
        moved = delta[top][category]
        text = f"{category} on {_where(top, layout)} ({moved * 1e3:+.0f} ms a step)"
        wait = max(waits, key=lambda c: median(d[c] for d in peers)) if peers else ""
        if wait and median(d[wait] for d in peers) > 0.25 * grown:
            text += f"; its peers wait in {wait}"
        else:
            wait = ""
        return {"category": category, "rank": top, "text": text, "moved_s": moved, "wait": wait, "concentrated": True}
    category = max(CATEGORIES, key=lambda c: median(d[c] for d in delta.values()))
    rank = max(delta, key=lambda r: delta[r][category])
    moved = delta[rank][category]
    share_before = median(was["time_s"].get(category, 0.0) / (was.get("wall_s") or 1.0) for _, was in pairs)
    took = median(d[category] for d in delta.values()) / grown if grown > 0 else 0.0
    # Alike everywhere, each category grows by its share of the step; a change grows one more.
    concentrated = took - share_before >= 0.5 * (1 - share_before)
    dim = WAIT_DIM.get(category, "")
    text = f"{category}"
    if dim and layout is not None and getattr(layout, dim, 1) > 1:
        members = layout.group_of(rank, ("ep", "dp") if dim == "dp" else (dim,))
        shown = ", ".join(map(str, members)) if len(members) <= 4 else f"{members[0]}, ... {len(members)} ranks"
        text += f" on {dim} group [{shown}]"
    link = _moved_link(rank, *rows[rank])
    text += f" ({link})" if link else f" ({_where(rank, layout)}, {moved * 1e3:+.0f} ms a step)"
    out = {"category": category, "rank": rank, "text": text, "moved_s": moved, "group": dim, "link": link}
    return out | {"concentrated": concentrated}
