"""`threefold eval --checkpoint DIR [--json] [--config FILE] [--data.* / --parallel.* / --train.* ...]`:
parse, tokenize once, and run threefold.inference.checkpoint_eval."""

from __future__ import annotations

import argparse
import json
import os

from threefold.config import parse_overrides
from threefold.inference.checkpoint_eval import check_eval_config, eval_config, run_eval

USAGE = """threefold eval --checkpoint DIR [--json] [--section.key VALUE ...]
  e.g. threefold eval --checkpoint ckpt --data.val_fraction 0.01 --parallel.tp 2"""


def eval_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="threefold eval", usage=USAGE)
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory, or a root holding some")
    parser.add_argument("--json", action="store_true", help='print {"loss": ..., "perplexity": ..., "tokens": ...}')
    parser.add_argument("--config", help="TOML file whose [data], [parallel], [train] tables apply")
    args, rest = parser.parse_known_args(argv)
    from threefold.data import load_tokens
    from threefold.data.tokenizer import check_vocab, open_tokenizer
    from threefold.inference.load import checkpoint_model_config

    _, manifest, _ = checkpoint_model_config(args.checkpoint)
    cfg = eval_config(manifest.config, args.config, parse_overrides(rest))
    check_eval_config(cfg, None if not os.environ.get("WORLD_SIZE") else int(os.environ["WORLD_SIZE"]))
    d, m = cfg.data, cfg.model
    if d.tokenizer:
        check_vocab(open_tokenizer(d.tokenizer), m.vocab, f"data.tokenizer {d.tokenizer}")
    stream = load_tokens(d.path, d.vocab, d.dtype, d.cache_dir, d.tokenizer)  # tokenize once, before spawning
    if stream.vocab_size > m.vocab:
        from threefold.errors import DataError

        raise DataError(
            f"{stream.source}: token ids go up to vocab {stream.vocab_size} but the checkpoint's "
            f"model.vocab is {m.vocab}"
        )
    result = run_eval(cfg, args.checkpoint)
    if int(os.environ.get("RANK", 0)) != 0:  # under torchrun every process runs this command
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"val loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}  on {result['tokens']:,} "
            f"held-out tokens ({stream.source})"
        )
    return 0
