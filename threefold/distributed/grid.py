"""The layout grid: global rank <-> (tp, cp, ep, dp, pp) coordinates, and every process group.

`RankLayout` is pure arithmetic (testable without processes), in the spirit of Megatron's
RankGenerator: an order string such as ``tp-cp-ep-dp-pp`` lists the dimensions fastest-varying
first, so with the default order a TP group is made of neighbouring ranks, i.e. inside one
node / NVLink domain, and PP is the outermost dimension.

Expert parallelism is carved out of data parallelism: the data-parallel degree is
``ep * edp`` and the ``dp`` token in the order string stands for the expert-data-parallel
remainder ``edp``. The full DP group (used for dense gradients) spans both ``ep`` and ``edp``.

`Grid` adds the process groups, created once and passed explicitly: there is no module-level
group state anywhere in threefold.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import timedelta

import torch

from threefold.distributed import comm
from threefold.distributed.comm import CommStats, Group  # noqa: F401 - the grid's groups are comm's
from threefold.errors import ConfigError

ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")
# Each named group: the ranks that differ only in these tokens ('dp' alone = edp). The full
# data-parallel group varies ep and edp. Replicas of one expert shard ("expert_dp"): experts are
# whole on every TP rank (which split the tokens), so their gradients are summed over tp and edp
# in one collective. "dp_cp": the replicas of a dense weight under context parallelism (cp ranks
# hold the same weights and see different tokens of the same samples), the group dense gradients
# are reduced and ZeRO-sharded over (Megatron's dp_cp); with cp 1 it is the dp group itself.
# "embed" (first and last stage of each pipeline: they share tied embeddings) is derived from "pp".
GROUP_DIMS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "pp": ("pp",),
    "dp": ("ep", "dp"),
    "cp": ("cp",),
    "dp_cp": ("ep", "dp", "cp"),
    "ep": ("ep",),
    "edp": ("dp",),
    "expert_dp": ("tp", "cp", "dp"),
}


@dataclass(frozen=True)
class RankLayout:
    """Sizes of each dimension and their order; all rank arithmetic, no communication."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1  # full data-parallel degree (includes ep)
    pp: int = 1
    order: str = "tp-cp-ep-dp-pp"

    def __post_init__(self) -> None:
        tokens = self.order.split("-")
        if sorted(tokens) != sorted(ORDER_TOKENS):
            raise ConfigError(
                "parallel.order", f"{self.order!r} must name each of tp, cp, ep, dp, pp once", "e.g. tp-cp-ep-dp-pp"
            )
        if self.dp % self.ep:
            raise ConfigError(
                "parallel.ep",
                f"ep={self.ep} does not divide dp={self.dp}",
                "experts are carved out of data-parallel ranks: choose ep dividing dp",
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def _sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.dp // self.ep, "pp": self.pp}

    @property
    def _strides(self) -> dict[str, int]:
        strides, step = {}, 1
        for token in self.order.split("-"):
            strides[token] = step
            step *= self._sizes[token]
        return strides

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of `rank`; `dp` is the full data-parallel index (edp * ep + ep_index)."""
        raw = {t: (rank // s) % self._sizes[t] for t, s in self._strides.items()}
        return {
            "tp": raw["tp"],
            "cp": raw["cp"],
            "ep": raw["ep"],
            "edp": raw["dp"],
            "dp": raw["dp"] * self.ep + raw["ep"],
            "pp": raw["pp"],
        }

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        raw = {"tp": tp, "cp": cp, "ep": dp % self.ep, "dp": dp // self.ep, "pp": pp}
        return sum(raw[t] * s for t, s in self._strides.items())

    def groups(self, varying: tuple[str, ...]) -> list[list[int]]:
        """All groups of ranks that differ only in the `varying` tokens ('dp' alone = edp)."""
        sizes, strides = self._sizes, self._strides
        fixed = [t for t in ORDER_TOKENS if t not in varying]
        out = []
        for base in itertools.product(*(range(sizes[t]) for t in fixed)):
            start = sum(c * strides[t] for t, c in zip(fixed, base))
            out.append(self._members(start, varying))
        return sorted(out)

    def group_of(self, rank: int, varying: tuple[str, ...]) -> list[int]:
        """The one group of `groups(varying)` that holds `rank`, in O(its size) (not O(world))."""
        strides = self._strides
        start = rank - sum((rank // strides[t]) % self._sizes[t] * strides[t] for t in varying)
        return self._members(start, varying)

    def _members(self, start: int, varying: tuple[str, ...]) -> list[int]:
        sizes, strides = self._sizes, self._strides
        return sorted(
            start + sum(c * strides[t] for t, c in zip(varying, combo))
            for combo in itertools.product(*(range(sizes[t]) for t in varying))
        )

    def groups_of(self, rank: int) -> dict[str, list[int]]:
        """This rank's group of every name (GROUP_DIMS, and "embed" on the first and last stages)."""
        out = {name: self.group_of(rank, dims) for name, dims in GROUP_DIMS.items()}
        pipeline = out["pp"]
        if rank in (pipeline[0], pipeline[-1]):
            out["embed"] = sorted({pipeline[0], pipeline[-1]})
        return out

    def group_lists(self) -> dict[str, list[list[int]]]:
        """Every group of every name, as lists of rank lists (O(world): tests and run records)."""
        out = {name: self.groups(dims) for name, dims in GROUP_DIMS.items()}
        out["embed"] = sorted(sorted({g[0], g[-1]}) for g in out["pp"])
        return out

    def check_placement(self, devices_per_node: int, allow_tp_across_nodes: bool) -> None:
        """Refuse a layout whose tensor-parallel groups leave the fast intra-node links."""
        if devices_per_node <= 0 or allow_tp_across_nodes:
            return
        for ranks in self.groups(("tp",)):
            if len({r // devices_per_node for r in ranks}) > 1:
                raise ConfigError(
                    "parallel.tp",
                    f"tensor-parallel group {ranks} would span nodes of {devices_per_node} devices",
                    "use tp <= devices per node with tp first in parallel.order, "
                    "or set parallel.allow_tp_across_nodes true",
                )


# The span category a group's collectives are timed as (when log.spans attaches a recorder).
SPAN_CATEGORY = {"tp": "tp_comm", "ep": "ep_a2a", "cp": "cp_comm"}


def _communicators(layout: RankLayout, rank: int, world: int, timeout: timedelta | None) -> dict[tuple, object]:
    """One communicator per distinct group of two or more ranks, keyed by its ranks: a group of
    one needs none, and names with the same members (dp and edp without ep, pp and embed at pp 2,
    ...) share one. Where the job's group can be split (NCCL with a bound device), one
    `split_group` per dimension creates all of its groups at once: a handful of calls per rank,
    whatever the world size. Otherwise `new_group` is collective over the whole job, so every rank
    creates every such group, in one order (by name, then rank list); it keeps the handles of its
    own."""
    made: dict[tuple, object] = {tuple(range(world)): comm.world_handle()}
    seen = set(made)
    split = comm.can_split()
    for lists in layout.group_lists().values():
        fresh = [tuple(ranks) for ranks in lists if len(ranks) > 1 and tuple(ranks) not in seen]
        if not fresh:
            continue
        seen.update(fresh)  # a dimension's groups are disjoint: one split of the world
        if split:
            pg = comm.split_group([list(k) for k in fresh], timeout=timeout)
            mine = [k for k in fresh if rank in k]
            if mine:
                made[mine[0]] = pg
            continue
        for key in fresh:
            pg = comm.new_group(list(key), timeout=timeout)
            if rank in key:
                made[key] = pg
    return made


def slowlink_delays(faults) -> tuple[tuple[int, int, float], ...]:
    """Grid.build's `link_delays` from parsed drills (distributed/drills.py): (a, b, seconds)
    of each slowlink fault."""
    return tuple((f.ranks[0], f.ranks[1], f.ms / 1000.0) for f in faults if f.kind == "slowlink")


def _delays_in(ranks: list[int], rank: int, link_delays) -> dict[int, float]:
    """{peer: seconds} for this rank in a group of `ranks`: the delayed links between this rank
    and another member (a group holding one end only does not cross the link)."""
    members, out = set(ranks), {}
    for a, b, seconds in link_delays:
        if rank in (a, b) and a in members and b in members and seconds > 0:
            peer = b if rank == a else a
            out[peer] = out.get(peer, 0.0) + seconds
    return out


def _lanes(layout: RankLayout, rank: int, names, groups: dict[str, Group], timeout) -> dict[str, Group]:
    """A second communicator over the same ranks as each group of `names` (all ranks call this,
    in one order): the parameter all-gathers' lane beside the gradient reductions' (FSDP2's
    separate all-gather and reduce-scatter streams). On NCCL a communicator has its own stream,
    on gloo its own queue and connections, so a prefetch never waits behind a reduction already
    in flight. One split per name where the job's group can be split, else one new_group per
    group of that name. Its traffic counts on the group's stats; its operations are numbered on
    its own OpLog (a communicator's sequence)."""
    out: dict[str, Group] = {}
    split = comm.can_split()
    for name in names:
        group = groups[name]
        if group.size == 1:
            continue
        lists = [g for g in layout.groups(GROUP_DIMS[name]) if len(g) > 1]
        if split:
            pg = comm.split_group(lists, timeout=timeout)
        else:
            pg = None
            for ranks in lists:
                made = comm.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    pg = made
        out[name] = Group(
            f"{name}:gather",
            group.ranks,
            pg,
            stats=group.stats,
            device=group.device,
            span_category=group.span_category,
            link_delays=group.link_delays,
        )
    return out


class Grid:
    """This rank's coordinates and process groups. Build once after init_process_group."""

    def __init__(self, layout: RankLayout, rank: int, groups: dict[str, Group], lanes: dict[str, Group] | None = None):
        self.layout, self.global_rank = layout, rank
        c = layout.coords(rank)
        self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank = c["tp"], c["cp"], c["dp"], c["pp"]
        self.ep_rank, self.edp_rank = c["ep"], c["edp"]
        self._groups = groups
        self.tp, self.pp, self.dp, self.cp = groups["tp"], groups["pp"], groups["dp"], groups["cp"]
        self.dp_cp = groups["dp_cp"]  # dense gradients' reduction and ZeRO's shards
        self.ep, self.edp = groups["ep"], groups["edp"]
        self.expert_dp = groups["expert_dp"]
        self.embed = groups.get("embed")  # None on ranks between the first and last stage
        self.world = groups["world"]
        self.lanes = dict(lanes or {})
        """Group name -> its all-gather lane (`_lanes`), for the groups built with one."""

    def lane(self, group: Group) -> Group:
        """The all-gather lane of `group`: its second communicator when the grid was built with
        one (Grid.build's `lanes`), else the group itself (one queue for both)."""
        return self.lanes.get(group.name, group)

    @classmethod
    def alone(cls, rank: int = 0, lanes: dict[str, Group] | None = None, **groups: Group) -> Grid:
        """A grid in which this rank is alone in every group (no process groups), but for the
        `groups` given (and their `lanes`, by group name): a model or engine built by one
        process, or on a sub-group of a job."""
        names = ["world", *RankLayout().group_lists()]
        every = {n: Group(n, [rank], None) for n in names}
        every.update(groups)
        if "dp_cp" not in groups:  # without cp the gradient replicas are the dp group
            every["dp_cp"] = every["dp"]
        layout = RankLayout(dp=every["dp"].size, tp=every["tp"].size, cp=every["cp"].size)
        return cls(layout, rank, every, lanes)

    @classmethod
    def build(
        cls,
        layout: RankLayout,
        timeout: timedelta | None = None,
        device: torch.device | str = "cpu",
        link_delays: tuple[tuple[int, int, float], ...] = (),
        lanes: tuple[str, ...] = (),
    ) -> Grid:
        """Create every group (all ranks must call this, in the same order). `timeout` bounds
        each collective on the sub-groups (torch would give them its own default, not the
        world group's): a hung peer becomes an error instead of a wait of half an hour.
        `device`: where the groups communicate (the run's device). `link_delays`: the slowlink
        drill, (rank a, rank b, seconds) per delayed link (`slowlink_delays` of the drill spec):
        on a and b, each group holding both waits that long before exchanging (comm.py).
        `lanes`: names of groups that also get an all-gather lane (`_lanes`; ZeRO's "dp_cp")."""
        rank, world = comm.global_rank(), comm.world_size()
        device = torch.device(device)
        if layout.world_size != world:
            raise ConfigError(
                "parallel",
                f"dp*tp*pp*cp = {layout.world_size} but the world has {world} processes",
                "make the product of degrees equal the number of processes",
            )
        groups: dict[str, Group] = {"world": Group("world", list(range(world)), comm.world_handle(), device=device)}
        made = _communicators(layout, rank, world, timeout)
        for name, ranks in layout.groups_of(rank).items():
            pg = made.get(tuple(ranks))  # None for a group of this rank alone
            groups[name] = Group(name, ranks, pg, device=device, span_category=SPAN_CATEGORY.get(name, "sync"))
        for group in groups.values():
            group.link_delays = _delays_in(group.ranks, rank, link_delays)
        if layout.cp == 1:  # the same replicas: the same object, so its traffic is counted as dp's
            groups["dp_cp"] = groups["dp"]
        names = sorted({groups[n].name for n in lanes})  # dp_cp is the dp group without cp
        return cls(layout, rank, groups, _lanes(layout, rank, names, groups, timeout))

    @property
    def groups(self) -> dict[str, Group]:
        """Every group this rank belongs to, by name (all-gather lanes as "<name>:gather")."""
        return {**self._groups, **{lane.name: lane for lane in self.lanes.values()}}

    def reset_stats(self) -> None:
        """Forget the communication recorded so far on every group."""
        for group in self._groups.values():
            group.stats.reset()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def describe(self) -> dict:
        lay = self.layout
        return {
            "world_size": lay.world_size,
            "tp": lay.tp,
            "cp": lay.cp,
            "ep": lay.ep,
            "dp": lay.dp,
            "pp": lay.pp,
            "order": lay.order,
            "groups": {
                k: v
                for k, v in lay.group_lists().items()
                if k in ("tp", "pp", "dp", "ep") or (lay.cp > 1 and "cp" in k)
            },
        }
