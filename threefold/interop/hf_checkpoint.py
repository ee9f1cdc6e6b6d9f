"""`threefold checkpoint import-hf HF_DIR OUT` and `threefold checkpoint export-hf CKPT OUT`.

Import reads config.json and model.safetensors (or the shards a model.safetensors.index.json
lists) and writes an ordinary one-file threefold checkpoint in the tensors' own dtype; the
resharding loader then places it into any layout. Export consolidates a checkpoint's `model/`
tensors and writes config.json plus safetensors, split into shards with an index above
--max-shard-mb, as `save_pretrained` does. A tokenizer.json travels along in both directions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from threefold.checkpoint.consolidate import consolidated
from threefold.checkpoint.io import open_checkpoint, save_whole
from threefold.checkpoint.manifest import CheckpointError
from threefold.config import Config, ModelConfig
from threefold.errors import UserError
from threefold.interop.hf_format import HfFormatError, from_hf, hf_config, model_fields, to_hf

INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise UserError(
            "Hugging Face checkpoints are safetensors files: install it with "
            "`pip install safetensors` (or the [hf] extra)"
        ) from None
    return st


def _empty_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: exists and is not empty (refusing to overwrite)")
    out.mkdir(parents=True, exist_ok=True)


def read_hf_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise HfFormatError(f"{hf_dir}: no such directory (expected a Hugging Face model directory)")
    if not path.is_file():
        raise HfFormatError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise HfFormatError(f"{path}: not valid JSON ({err})") from None


def read_hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    st = _safetensors()
    index = hf_dir / INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise HfFormatError(
            f"{hf_dir}: no model.safetensors or {INDEX} (only safetensors weights are read; "
            "re-save the model with save_pretrained(safe_serialization=True))"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if not (hf_dir / name).is_file():
            raise HfFormatError(f"{hf_dir}: shard {name} listed in {INDEX} is missing")
        tensors.update(st.load_file(str(hf_dir / name)))
    return tensors


def _check_shapes(tensors: dict[str, torch.Tensor], m: ModelConfig, where: str) -> None:
    """Every tensor the threefold model has is present with its shape, and nothing else."""
    from threefold.model.meta import on_meta
    from threefold.model.transformer import Transformer

    with on_meta():
        model = Transformer(m)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise HfFormatError(
            f"{where}: tensors do not match the config (missing: {missing[:3]}, unexpected: {extra[:3]})"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise HfFormatError(f"{where}: {name} has shape {tuple(tensors[name].shape)}, the config implies {shape}")


def import_hf(hf_dir: str, out: str) -> Path:
    src, dst = Path(hf_dir), Path(out)
    hf = read_hf_config(src)
    fields = model_fields(hf, str(src / "config.json"))
    cfg = Config()
    for key, value in fields.items():
        setattr(cfg.model, key, value)
    hf_tensors = read_hf_tensors(src)
    tensors = from_hf(hf_tensors, fields, str(src))
    _check_shapes(tensors, cfg.model, str(src))
    _empty_out(dst)
    if (src / TOKENIZER).is_file():
        shutil.copyfile(src / TOKENIZER, dst / TOKENIZER)
        cfg.data.tokenizer = str((dst / TOKENIZER).resolve())
    layout = {"tp": 1, "pp": 1, "dp": 1, "world_size": 1, "source": "huggingface"}
    model = {f"model/{name}": t for name, t in tensors.items()}
    return save_whole(dst, 0, model, cfg.to_dict(), layout, {"hf_config": hf})


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    return groups


def export_hf(ckpt: str, out: str, max_shard_mb: float = 5000.0) -> Path:
    st = _safetensors()
    directory, manifest = open_checkpoint(ckpt)
    m = manifest.config["model"]
    if m.get("num_experts"):
        raise HfFormatError(
            f"{directory}: a mixture-of-experts model has no Hugging Face layout here "
            "(export-hf writes dense Llama, Qwen2 and GPT-2 models)"
        )
    tensors = to_hf(consolidated(directory, manifest), m)
    dst = Path(out)
    _empty_out(dst)
    groups = _shards(dict(sorted(tensors.items())), int(max_shard_mb * 2**20))
    if len(groups) == 1:
        st.save_file(groups[0], str(dst / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, group in enumerate(groups):
            name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            st.save_file(group, str(dst / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in group})
            total += sum(t.numel() * t.element_size() for t in group.values())
        (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    dtypes = {str(t.dtype).replace("torch.", "") for t in tensors.values()}
    config = hf_config(m, manifest.extra.get("hf_config"))
    config["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer = manifest.config.get("data", {}).get("tokenizer", "")
    if tokenizer and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, dst / TOKENIZER)
    return dst
