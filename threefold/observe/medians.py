"""Medians that leave some values out, for comparing each member with its peers: one sort, then
O(len(left out)) per query (observe/links.py's ranks, pairs and groups; observe/hops.py's hops)."""

from __future__ import annotations


def medians_without(values: list[float], drop: list[list[int]]) -> list[float]:
    """For each index list in `drop`, the median of the values outside it: one sort, then
    O(len(list)) per list (ranks of a dimension; a node's ranks among its stage's)."""
    n = len(values)
    order = sorted(range(n), key=values.__getitem__)
    ranked = [values[i] for i in order]
    position = {i: k for k, i in enumerate(order)}
    out = []
    for indices in drop:
        removed = sorted(position[i] for i in indices)
        m = n - len(removed)

        if m <= 0:
            out.append(0.0)
            continue
        mid = [kept(ranked, removed, m // 2)]
        if m % 2 == 0:
            mid.append(kept(ranked, removed, m // 2 - 1))
        out.append(sum(mid) / len(mid))
    return out


def kept(ranked: list[float], removed: list[int], j: int) -> float:
    """The j-th smallest of `ranked` (sorted) once the positions `removed` (sorted) are left out."""
    for p in removed:
        j += p <= j
    return ranked[j]


def medians_of_others(values: list[float]) -> list[float]:
    """For each value, the median of all the others (with few peers one outlier would drag the
    median of all towards itself)."""
    return medians_without(values, [[i] for i in range(len(values))])
