"""Token dispatch and combine over the expert-parallel group.

The MoE layer hands over its (token, expert) assignments sorted by global expert id, the
dropped ones last, with the count of kept ones per expert. Experts are laid out contiguously
(rank j holds experts [j * E/ep, (j+1) * E/ep)), so the sorted rows are already grouped by
destination rank:

    1. exchange counts      [ep, E/ep] per rank (tiny all-to-all), then the layer's one host
                            read: the split sizes both ways and the rows per local expert
    2. dispatch             all-to-all of the kept rows (uneven splits)
    3. regroup              received rows are grouped by source rank; sort them by local expert
    4. experts              one grouped GEMM over this rank's experts (or the padded batch,
                            sized from the same read)
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

    def run(self, x: torch.Tensor, counts: torch.Tensor, experts, may_drop: bool = False) -> torch.Tensor:
        """The layer's rows out and back (LocalDispatcher.run's contract). Only the kept rows
        travel, so every row that reaches the experts is routed, whatever `may_drop` says."""
        ep = self.group.size
        send_counts = counts.view(ep, self.local)
        recv_counts = exchange_counts(send_counts, self.group)  # [source rank, local expert]
        # The one host read: all-to-all takes its split sizes as host integers.
        sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1), recv_counts.sum(0)]).tolist()
        send, recv, per_expert = sizes[:ep], sizes[ep : 2 * ep], sizes[2 * ep :]
        kept, arrived = sum(send), sum(recv)
        received = all_to_all(x[:kept], send, recv, self.group)
        local_expert = torch.repeat_interleave(
            torch.arange(self.local, device=x.device).repeat(ep), recv_counts.flatten(), output_size=arrived
        )
        order = torch.argsort(local_expert, stable=True)  # by expert, then source rank
        y = experts(received[order], recv_counts.sum(0), host_counts=per_expert)
        back = torch.empty_like(y).index_copy(0, order, y)  # rows in the order they arrived
        out = all_to_all(back, recv, send, self.group)
        if kept == x.shape[0]:
            return out
        return torch.cat([out, out.new_zeros(x.shape[0] - kept, out.shape[-1])])  # the dropped rows

    def __repr__(self) -> str:
        return f"AllToAllDispatcher({self.group.name}, {self.local} experts here)"
