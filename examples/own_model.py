"""Train your own model with threefold: a GPT-J-style block (attention and a GELU MLP in
parallel from one LayerNorm) written with plain torch modules, a tensor-parallel plan by module
name, and threefold's layouts, checkpoints and metrics.

    python examples/own_model.py                                   # tp 2 x dp 1, 30 steps
    python examples/own_model.py --parallel.pp 2 --parallel.tp 1   # any --section.key override
    threefold train --model.arch examples/own_model.py:build       # the same model from the CLI

The workers import `build` from this file by its path (model.arch), so everything the model
needs is defined at module level and the run itself sits under `if __name__ == "__main__"`.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

import threefold


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [seq, batch] -> [seq, batch, hidden]
        return self.wte(tokens)


class ParallelBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.ln = nn.LayerNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.fc_in = nn.Linear(hidden, ffn)
        self.fc_out = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(x)
        q, k, v = self.q(y), self.k(y), self.v(y)
        # Shapes from the projections: under tensor parallelism a rank holds heads/tp of the
        # heads (-1), and under sequence parallelism y holds seq/tp rows, the projections all.
        s, b = q.shape[:2]
        q, k, v = (t.view(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, -1)
        return x + self.out(attn) + self.fc_out(F.gelu(self.fc_in(y)))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln_f(x))


def init(name: str, shape: tuple[int, ...]):
    """Layout-invariant initialization hook: a std, "zeros", "ones", or None (the default rule)."""
    if name.endswith("wte.weight"):
        return 0.02
    return None


def build(cfg) -> threefold.ModelSpec:
    """cfg is the run's model section: hidden, layers, heads, ffn_hidden, vocab, seq_len, ..."""
    return threefold.ModelSpec(
        embed=lambda: Embed(cfg.vocab, cfg.hidden),
        block=lambda i: ParallelBlock(cfg.hidden, cfg.heads, cfg.ffn_hidden),
        head=lambda: Head(cfg.hidden, cfg.vocab),
        plan={
            "tok_embed.wte": "vocab",
            "layers.*.q": "column",
            "layers.*.k": "column",
            "layers.*.v": "column",
            "layers.*.out": "row",
            "layers.*.fc_in": "column",
            "layers.*.fc_out": "row",
            "head.proj": "vocab",
        },
        init=init,
    )


def show(record: dict) -> None:
    """Each step's metrics record, on rank 0 (module level: with several ranks it runs in a worker)."""
    print(f"step {record['step']:3d}  loss {record['loss']:.4f}", flush=True)


if __name__ == "__main__":
    cfg = threefold.configure(
        {
            "model": {"hidden": 64, "layers": 4, "heads": 4, "kv_heads": 4, "ffn_hidden": 256, "seq_len": 64},
            "parallel": {"tp": 2},
            "train": {"steps": 30, "global_batch": 8, "micro_batch": 4, "warmup_steps": 5},
            "log": {"dir": "runs/own_model", "quiet": True},
        },
        sys.argv[1:],
    )
    last = threefold.train(cfg, model=build, callbacks=threefold.Callbacks(on_metrics=show))
    print(f"done: loss {last['loss']:.4f} after {last['step']} steps; metrics in {cfg.log.dir}/metrics.jsonl")
