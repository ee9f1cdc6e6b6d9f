"""data.document_mask with GQA: which fused attention form is fastest on this device.

    python bench/document_mask_attention.py [--seq 1024 2048] [--rounds 9] [--steps 3]

One forward + backward of masked grouped-query attention (8 query heads, 2 kv heads, head dim
64, a block-diagonal causal document mask of documents 64-512 tokens long), in fp32 on the CPU
(or `--device cuda` in bf16), through each form threefold could run:

  gqa      SDPA(attn_mask, enable_gqa=True): K/V stay at kv heads. On CPU the flash kernel
           takes both; on CUDA flash refuses the mask and efficient refuses enable_gqa, so
           SDPA falls to the math kernel and materializes the s^2 scores
  expand   K/V expanded to the query heads (a view expanded and reshaped: no host sync), then
           SDPA(attn_mask): on CUDA the efficient kernel takes it
  math     the math kernel alone (sdpa_kernel([MATH])): the materialized reference
  flex     FlexAttention with the mask as a block mask (torch.compile'd); on CPU its backward
           raises NotImplementedError in torch 2.13, so the row says it was refused

Contestants alternate in rounds (gqa, expand, math, gqa, ...; bench/timing.py), a round being
one block of `--steps` steps each; reported per contestant: median step [IQR] in ms, the SDPA
kernel that served it (read from the profiler: the aten op that ran), and the median per-round
ratio to `gqa` with its 95% bootstrap interval (bench/stats.py). The last line names the form
AttentionCore runs on this device and the kernel that served it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from stats import show  # noqa: E402
from timing import alternate, cell, ratio, steps_of  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from threefold.model.layers import AttentionCore, expand_kv_heads, sdpa_backend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64

# The aten op each SDPA kernel runs as (forward), as the profiler names it.
KERNEL_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


def document_mask(batch: int, seq: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """[batch, 1, seq, seq] block-diagonal causal, documents of 64-512 tokens."""
    gen = torch.Generator().manual_seed(seed)
    segment = torch.zeros(batch, seq, dtype=torch.long)
    for b in range(batch):
        at, doc = 0, 0
        while at < seq:
            n = int(torch.randint(64, 513, (1,), generator=gen))
            segment[b, at : at + n] = doc
            at, doc = at + n, doc + 1
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return ((segment[:, :, None] == segment[:, None, :]) & causal).unsqueeze(1).to(device)


def served_kernels(fn) -> str:
    """The SDPA kernels that ran inside fn() (profiler op names), or "none seen"."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    seen = sorted({KERNEL_OPS[e.name] for e in prof.events() if e.name in KERNEL_OPS})
    return ", ".join(seen) or "none seen"


def contestants(q, k, v, mask) -> dict:
    """name -> a forward + backward of that attention form (gradients into q, k, v)."""
    heads = q.shape[1]

    def step(attend):
        def run():
            q.grad = k.grad = v.grad = None
            attend().sum().backward()

        return run

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def expand():
        return F.scaled_dot_product_attention(q, expand_kv_heads(k, heads), expand_kv_heads(v, heads), attn_mask=mask)

    def math():
        with sdpa_kernel([SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return {"gqa": step(gqa), "expand": step(expand), "math": step(math)}


def flex_row(q, k, v, mask) -> str:
    """FlexAttention's verdict: its step time, or the first line of why it was refused."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        batch, seq = q.shape[0], q.shape[2]
        block = create_block_mask(lambda b, h, i, j: mask[b, 0, i, j], batch, None, seq, seq, q.device)
        flex = torch.compile(flex_attention)
        step = lambda: flex(q, k, v, block_mask=block, enable_gqa=True).sum().backward()  # noqa: E731
        return cell(steps_of(alternate({"flex": step}, 3, 2, warmup=1)["flex"]))
    except Exception as err:  # noqa: BLE001 - any refusal is the row's verdict
        return f"refused: {type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-flex", action="store_true", help="skip the FlexAttention row (its compile takes ~30 s)")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    print(f"threads {torch.get_num_threads()}, {device} {str(dtype)[6:]}, heads {HEADS}/{KV_HEADS}, hd {HEAD_DIM}")
    for seq in args.seq:
        gen = torch.Generator().manual_seed(seq)
        shapes = [(args.batch, h, seq, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS)]
        q, k, v = (torch.randn(s, generator=gen).to(device, dtype).requires_grad_() for s in shapes)
        mask = document_mask(args.batch, seq, device)
        steps = contestants(q, k, v, mask)
        kernels = {name: served_kernels(step) for name, step in steps.items()}
        times = alternate(steps, args.rounds, args.steps, warmup=1)
        print(f"\nseq {seq}, batch {args.batch}: {args.rounds} rounds x {args.steps} steps")
        print(f"{'form':<8} {'step ms [IQR]':<22} {'kernel':<14} vs gqa (median per-round ratio, 95% CI)")
        for name in steps:
            vs = "1" if name == "gqa" else show(ratio(times, name, "gqa"))
            print(f"{name:<8} {cell(steps_of(times[name])):<22} {kernels[name]:<14} {vs}")
        if not args.no_flex:
            print(f"{'flex':<8} {flex_row(q, k, v, mask)}")
        core = AttentionCore()
        expanded = core.expands_kv(q, k, mask)
        served = sdpa_backend(q, *(expand_kv_heads(t, HEADS) for t in (k, v)) if expanded else (k, v), mask)
        print(f"AttentionCore here: {'expand' if expanded else 'gqa'}, served by {served}")


if __name__ == "__main__":
    main()
