"""Token dispatch and combine over the expert-parallel group.

The MoE layer hands over its kept (token, expert) assignments sorted by global expert id, with
the count per expert. Experts are laid out contiguously (rank j holds experts
[j * E/ep, (j+1) * E/ep)), so the sorted rows are already grouped by destination rank:

    1. exchange counts      [ep, E/ep] per rank (tiny all-to-all): the split sizes
    2. dispatch             all-to-all of the rows (uneven splits)
    3. regroup              received rows are grouped by source rank; sort them by local expert
    4. experts              one batched matmul over this rank's experts
    5. combine              undo the regrouping, all-to-all back (the same splits reversed)

Rows come back in the order they were sent, so the layer's weighted sum is the same
arithmetic as with every expert local: losses do not depend on ep.
"""

from __future__ import annotations

import torch

from threefold.distributed.expert_parallel.mappings import all_to_all, exchange_counts
from threefold.distributed.grid import Group


class AllToAllDispatcher:
    def __init__(self, group: Group, num_experts: int):
        self.group, self.local = group, num_experts // group.size

    def run(self, x: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
        ep = self.group.size
        send_counts = counts.view(ep, self.local)
        recv_counts = exchange_counts(send_counts, self.group)  # [source rank, local expert]
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        received = all_to_all(x, send, recv, self.group)
        local_expert = torch.repeat_interleave(
            torch.arange(self.local, device=x.device).repeat(ep), recv_counts.flatten()
        )
        order = torch.argsort(local_expert, stable=True)  # by expert, then source rank
        y = experts(received[order], recv_counts.sum(0))
        back = torch.empty_like(y).index_copy(0, order, y)  # rows in the order they arrived
        return all_to_all(back, recv, send, self.group)

    def __repr__(self) -> str:
        return f"AllToAllDispatcher({self.group.name}, {self.local} experts here)"
