"""`threefold generate --checkpoint DIR --prompt TEXT [--temperature T --top-k K --top-p P]`."""

from __future__ import annotations

import argparse
import sys

from threefold.errors import ConfigError
from threefold.inference.generate import generate, load_consolidated


def generate_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="threefold generate")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory (any layout), or a root")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely ids (0 = all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus: smallest set with this probability")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the checkpoint's data.tokenizer)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = parser.parse_args(argv)
    if args.temperature < 0:
        raise ConfigError("--temperature", f"{args.temperature} is negative", "0 (greedy) or more")
    if not 0 < args.top_p <= 1:
        raise ConfigError("--top-p", f"{args.top_p} is outside (0, 1]")
    if args.top_k < 0 or args.max_new_tokens < 0:
        raise ConfigError("--top-k/--max-new-tokens", "must be >= 0")
    from threefold.data.tokenizer import check_vocab, open_tokenizer
    from threefold.distributed.runtime import resolve_device

    device = resolve_device(args.device, 0)
    model, config = load_consolidated(args.checkpoint, device)
    path = config.get("data", {}).get("tokenizer", "") if args.tokenizer is None else args.tokenizer
    tok = open_tokenizer(path)
    check_vocab(tok, model.cfg.vocab, f"tokenizer {path or 'byte-level'}")
    prompt = tok.encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt", "is empty after tokenization", "give at least one character")
    ids = generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        usable_vocab=tok.vocab_size,
        stop=tok.separator,
    )
    sys.stdout.write(args.prompt + tok.decode(ids) + "\n")
    return 0
