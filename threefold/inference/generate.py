"""`threefold generate --checkpoint DIR --prompt TEXT`: sampling with a KV cache.

The checkpoint (of any layout) is consolidated into one plain model on one process. Decoding
reuses the model's own modules (norms, projections, MLP, head) and only replaces the attention
step: keys and values of earlier positions are kept per layer, so each new token costs one
position's work instead of a forward over the whole sequence. Positions (rotary angles or the
GPT-2 table) are offset by the cache length. Sampling: greedy (temperature 0), or temperature
with optional top-k and nucleus (top-p) filtering, from a seeded generator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from threefold.model.layers import apply_rope, rope_tables


class KVCache:
    """Keys and values [batch, kv_heads, positions, head_dim] of every layer so far."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is not None:
            k, v = torch.cat((self.k[layer], k), dim=2), torch.cat((self.v[layer], v), dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


def _attend(attn: nn.Module, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
    s, b, pos = x.shape[0], x.shape[1], cache.length
    q, k, v = (t.view(s, b, -1, attn.head_dim) for t in (attn.wq(x), attn.wk(x), attn.wv(x)))
    if attn.use_rope:
        cos, sin = rope_tables(pos + s, attn.head_dim, attn.rope_theta, x.device)
        cos, sin = cos[pos:], sin[pos:]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, hd]
    k, v = cache.extend(layer, k, v)
    # New query i sits at position pos + i and sees every key up to there.
    mask = torch.arange(pos + s, device=x.device)[None, :] <= (pos + torch.arange(s, device=x.device))[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return attn.wo(out.permute(2, 0, 1, 3).reshape(s, b, -1))


@torch.no_grad()
def cached_forward(model: nn.Module, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [batch, new, vocab] of `tokens` [batch, new] following the cached positions."""
    pos, s = cache.length, tokens.shape[1]
    x = model.tok_embed(tokens.t())
    if model.pos_embed is not None:
        x = x + model.pos_embed.weight[pos : pos + s, None, :]
    for i, block in enumerate(model.layers.values()):
        x = x + _attend(block.attn, block.attn_norm(x), cache, i)
        x = x + block.mlp(block.mlp_norm(x))
    cache.length += s
    return model.head(model.norm(x)).transpose(0, 1)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Next ids [batch] from last-position logits [batch, vocab]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    max_new: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    usable_vocab: int | None = None,
    stop: int | None = None,
    max_len: int | None = None,
) -> list[int]:
    """Continue `prompt` by up to `max_new` ids (fewer at `stop` or at `max_len` positions)."""
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    max_len = max_len or model.cfg.seq_len
    prompt = prompt[-(max_len - 1) :]
    cache = KVCache(len(model.layers))
    logits = cached_forward(model, torch.tensor([prompt], device=device), cache)[:, -1]
    out: list[int] = []
    while len(out) < max_new and cache.length < max_len:
        if usable_vocab is not None:  # ids past the tokenizer's (a padded embedding) decode to nothing
            logits[:, usable_vocab:] = float("-inf")
        nxt = int(sample(logits, temperature, top_k, top_p, gen)[0])
        if nxt == stop:
            break
        out.append(nxt)
        logits = cached_forward(model, torch.tensor([[nxt]], device=device), cache)[:, -1]
    return out


def load_consolidated(path: str, device: torch.device) -> tuple[nn.Module, dict]:
    """A plain model holding every weight of the checkpoint at `path` (any layout); its config dict."""
    from threefold.checkpoint.consolidate import consolidated
    from threefold.inference.load import checkpoint_model_config
    from threefold.model.transformer import Transformer

    directory, manifest, m = checkpoint_model_config(path)
    model = Transformer(m)
    weights = consolidated(directory, manifest)
    if m.tie_embeddings:
        weights.pop("head.weight", None)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not (m.tie_embeddings and k == "head.weight")]
    if missing or unexpected:
        from threefold.checkpoint import CheckpointError

        raise CheckpointError(
            f"{directory}: weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    return model.to(device).float(), manifest.config
