"""Named model presets: the shapes `model.preset` fills in, and the optimizer schedule each
reference size was trained with in its paper (threefold.config applies both)."""

from __future__ import annotations

from typing import Any

# Shapes: tiny runs seconds-per-step tests on CPU; small is ~20M parameters; the rest are
# the published reference sizes used for planning.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden=128, layers=4, heads=4, kv_heads=2, ffn_hidden=352, vocab=256, seq_len=128),
    "small": dict(hidden=512, layers=6, heads=8, kv_heads=4, ffn_hidden=1408, vocab=256, seq_len=256),
    "gpt-1.3b": dict(
        arch="gpt2",
        hidden=2048,
        layers=24,
        heads=16,
        kv_heads=16,
        ffn_hidden=8192,
        vocab=50304,
        seq_len=2048,
        tie_embeddings=True,
    ),
    "gpt-175b": dict(
        arch="gpt2",
        hidden=12288,
        layers=96,
        heads=96,
        kv_heads=96,
        ffn_hidden=49152,
        vocab=51200,
        seq_len=2048,
        tie_embeddings=True,
    ),
    "llama-7b": dict(hidden=4096, layers=32, heads=32, kv_heads=32, ffn_hidden=11008, vocab=32000, seq_len=4096),
    "llama-70b": dict(
        hidden=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672, vocab=32000, seq_len=4096, rope_theta=500000.0
    ),
    # OLMoE-1B-7B (Muennighoff et al. 2024): 64 SwiGLU experts of width 1024 per block, top-8;
    # 6.9B parameters, 1.3B active. (Its QK-norm is not modelled; shapes and counts match.)
    "olmoe-1b-7b": dict(
        hidden=2048,
        layers=16,
        heads=16,
        kv_heads=16,
        ffn_hidden=1024,
        vocab=50304,
        seq_len=4096,
        num_experts=64,
        top_k=8,
    ),
}


# The optimizer schedule each reference preset was trained with, in its paper; applied to the
# train keys the user did not set (the other presets keep the TrainConfig defaults).
#   GPT-3 (Brown et al. 2020, Table 2.1 and Appendix B): peak learning rate per size (1.3B 2.0e-4,
#   175B 0.6e-4), linear warm-up over the first 375M tokens, cosine decay to 10% of the peak.
#   Llama 2 (Touvron et al. 2023, sec. 2.2): peak 3e-4 for 7B/13B and 1.5e-4 for 34B/70B, 2000
#   warm-up steps, cosine decay to 10% of the peak.
# Both used AdamW with beta1 0.9, beta2 0.95, weight decay 0.1 and clipping at 1.0: the defaults.
# `warmup_tokens` becomes warm-up steps of this run's global_batch * seq_len tokens.
PRESET_TRAIN: dict[str, dict[str, float]] = {
    "gpt-1.3b": dict(lr=2.0e-4, min_lr_ratio=0.1, warmup_tokens=375e6),
    "gpt-175b": dict(lr=0.6e-4, min_lr_ratio=0.1, warmup_tokens=375e6),
    "llama-7b": dict(lr=3.0e-4, min_lr_ratio=0.1, warmup_steps=2000),
    "llama-70b": dict(lr=1.5e-4, min_lr_ratio=0.1, warmup_steps=2000),
}
