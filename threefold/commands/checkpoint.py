"""`threefold checkpoint info DIR`, `export DIR OUT`, and `import-hf` / `export-hf` (threefold.interop)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from threefold.checkpoint.consolidate import consolidated
from threefold.checkpoint.io import open_checkpoint
from threefold.checkpoint.manifest import CheckpointError
from threefold.errors import UserError


def _info(args) -> int:
    directory, manifest = open_checkpoint(args.path)
    size = sum(meta["bytes"] for meta in manifest.files.values())
    lay = manifest.layout
    params = sum(torch.Size(e.shape).numel() for n, e in manifest.tensors.items() if n.startswith("model/"))
    print(f"checkpoint  {directory}")
    print(f"step        {manifest.step}")
    print(f"layout      tp={lay.get('tp')} pp={lay.get('pp')} dp={lay.get('dp')} ({lay.get('world_size')} ranks)")
    m = manifest.config["model"]
    print(f"model       {m['arch']} {m['layers']} layers x {m['hidden']} hidden, {params:,} parameters")
    print(f"files       {len(manifest.files)} shard files, {size / 2**20:.1f} MiB, checksums verified")
    return 0


def _export(args) -> int:
    directory, manifest = open_checkpoint(args.path)
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError(
            "checkpoint export writes safetensors: install it with "
            "`pip install safetensors` (or the [safetensors] extra)"
        ) from None
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty (refusing to overwrite)")
    out.mkdir(parents=True, exist_ok=True)
    tensors = consolidated(directory, manifest)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"step": str(manifest.step), "format": "threefold"},
    )
    import json

    (out / "config.json").write_text(json.dumps(manifest.config, indent=1))
    print(f"exported {len(tensors)} tensors of step {manifest.step} to {out / 'model.safetensors'}")
    return 0


def checkpoint_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="threefold checkpoint")
    sub = parser.add_subparsers(dest="action", required=True)
    info = sub.add_parser("info", help="layout, step, size; verifies every checksum")
    info.add_argument("path", help="a checkpoint directory, or checkpoint.dir (its newest checkpoint)")
    export = sub.add_parser("export", help="one consolidated safetensors file of the model weights")
    export.add_argument("path")
    export.add_argument("out")
    imp = sub.add_parser("import-hf", help="a Hugging Face Llama/Qwen2/GPT-2 directory -> a threefold checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("out")
    exp = sub.add_parser("export-hf", help="a threefold checkpoint -> a Hugging Face directory (config + safetensors)")
    exp.add_argument("path")
    exp.add_argument("out")
    exp.add_argument("--max-shard-mb", type=float, default=5000.0, help="split safetensors files above this size")
    args = parser.parse_args(argv)
    if args.action == "import-hf":
        from threefold.interop.hf_checkpoint import import_hf

        print(f"imported {args.hf_dir} to {import_hf(args.hf_dir, args.out)}")
        return 0
    if args.action == "export-hf":
        from threefold.interop.hf_checkpoint import export_hf

        print(f"exported {args.path} to {export_hf(args.path, args.out, args.max_shard_mb)}")
        return 0
    return _info(args) if args.action == "info" else _export(args)
