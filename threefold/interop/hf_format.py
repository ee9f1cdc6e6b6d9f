"""The Hugging Face layout of Llama-family (Llama 2/3, Qwen2) and GPT-2 models, both ways.

Configs map field by field to `model.*`; tensors map by name, with two changes of form:

  * rotary pairs: threefold rotates interleaved pairs (x[2i], x[2i+1]), Hugging Face rotates
    the two halves of each head (x[i], x[i + hd/2]). The q/k projection rows (and q/k biases)
    are permuted per head between the two orders; the permutation moves values, never changes
    them, so a round trip is bit-exact.
  * GPT-2's Conv1D stores weights as [in, out] and fuses q, k, v into one `c_attn`: transposed
    and split (or concatenated) on the way.

Anything the threefold model cannot reproduce exactly (rope scaling, other activations, biases
where it has none) is refused with one line instead of being converted approximately.
"""

from __future__ import annotations

import torch

from threefold.errors import UserError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}


class HfFormatError(UserError):
    """A Hugging Face directory threefold cannot convert exactly."""


def _refuse(where: str, key: str, value, valid: str) -> None:
    raise HfFormatError(f"{where}: {key}={value!r} is not supported (valid: {valid})")


def model_type_of(hf: dict, where: str) -> str:
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        arch = ",".join(hf.get("architectures") or []) or "?"
        raise HfFormatError(
            f"{where}: architecture {arch} (model_type {kind!r}) is not supported "
            f"(valid: {', '.join(ARCHITECTURES.values())})"
        )
    return kind


def _rope_theta(hf: dict, where: str) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        _refuse(where, "rope_type", kind, "default (no rope scaling)")
    return float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)


def model_fields(hf: dict, where: str) -> dict:
    """`model.*` values of the threefold model equal to the Hugging Face config `hf`."""
    kind = model_type_of(hf, where)
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            _refuse(where, "activation_function", act, "gelu_new, gelu_pytorch_tanh")
        if hf.get("scale_attn_by_inverse_layer_idx"):
            _refuse(where, "scale_attn_by_inverse_layer_idx", True, "false")
        if hf.get("scale_attn_weights") is False:
            _refuse(where, "scale_attn_weights", False, "true")
        hidden = hf["n_embd"]
        return dict(
            arch="gpt2",
            hidden=hidden,
            layers=hf["n_layer"],
            heads=hf["n_head"],
            kv_heads=hf["n_head"],
            ffn_hidden=hf.get("n_inner") or 4 * hidden,
            vocab=hf["vocab_size"],
            seq_len=hf["n_positions"],
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            qkv_bias=False,
        )
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", hf.get("hidden_act"), "silu")
    if hf.get("mlp_bias"):
        _refuse(where, "mlp_bias", True, "false")
    if kind == "llama" and hf.get("attention_bias"):
        _refuse(where, "attention_bias", True, "false (Qwen2-style q/k/v biases come with model_type qwen2)")
    if kind == "qwen2" and hf.get("use_sliding_window"):
        _refuse(where, "use_sliding_window", True, "false")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hidden // heads):
        _refuse(where, "head_dim", hf["head_dim"], f"hidden_size/num_attention_heads = {hidden // heads}")
    return dict(
        arch="llama",
        hidden=hidden,
        layers=hf["num_hidden_layers"],
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden=hf["intermediate_size"],
        vocab=hf["vocab_size"],
        seq_len=hf["max_position_embeddings"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(hf, where),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2",
    )


def hf_config(m: dict, base: dict | None = None) -> dict:
    """A Hugging Face config.json for threefold `model.*` values `m`; `base` (the config an
    imported model came with) keeps fields threefold does not model, such as token ids."""
    out = dict(base or {})
    if m["arch"] == "gpt2":
        drop = m.get("dropout", 0.0)
        out.update(
            architectures=["GPT2LMHeadModel"],
            model_type="gpt2",
            n_embd=m["hidden"],
            n_layer=m["layers"],
            n_head=m["heads"],
            n_inner=m["ffn_hidden"],
            vocab_size=m["vocab"],
            n_positions=m["seq_len"],
            layer_norm_epsilon=m["norm_eps"],
            activation_function=out.get("activation_function", "gelu_new"),
            tie_word_embeddings=m["tie_embeddings"],
            scale_attn_weights=True,
            scale_attn_by_inverse_layer_idx=False,
        )
        if base is None:
            out.update(resid_pdrop=drop, embd_pdrop=drop, attn_pdrop=0.0, initializer_range=m["init_std"])
        elif base.get("n_inner") is None and m["ffn_hidden"] == 4 * m["hidden"]:
            out["n_inner"] = None  # "4 x n_embd", as the imported config said
        return out
    kind = "qwen2" if m.get("qkv_bias") else "llama"
    out.update(
        architectures=[ARCHITECTURES[kind]],
        model_type=kind,
        hidden_size=m["hidden"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        intermediate_size=m["ffn_hidden"],
        vocab_size=m["vocab"],
        max_position_embeddings=m["seq_len"],
        rms_norm_eps=m["norm_eps"],
        hidden_act="silu",
        tie_word_embeddings=m["tie_embeddings"],
        head_dim=m["hidden"] // m["heads"],
        rope_parameters={"rope_type": "default", "rope_theta": m["rope_theta"]},
    )
    out.pop("rope_theta", None)
    out.pop("rope_scaling", None)
    if kind == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if base is None:
        out.update(initializer_range=m["init_std"], attention_dropout=0.0)
    return out


def _to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Per head, rows [half | half] -> interleaved pairs (Hugging Face -> threefold rotary order)."""
    hd = w.shape[0] // heads
    return w.reshape(heads, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    hd = w.shape[0] // heads
    return w.reshape(heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


_LLAMA_BLOCK = {
    "self_attn.q_proj": "attn.wq",
    "self_attn.k_proj": "attn.wk",
    "self_attn.v_proj": "attn.wv",
    "self_attn.o_proj": "attn.wo",
    "mlp.gate_proj": "mlp.w1",
    "mlp.up_proj": "mlp.w3",
    "mlp.down_proj": "mlp.w2",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "mlp_norm",
}
_GPT2_BLOCK = {
    "ln_1": "attn_norm",
    "ln_2": "mlp_norm",
    "attn.c_proj": "attn.wo",
    "mlp.c_fc": "mlp.w1",
    "mlp.c_proj": "mlp.w2",
}
_GPT2_IGNORED = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old GPT-2 files


def from_hf(hf_tensors: dict[str, torch.Tensor], m: dict, where: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> threefold logical tensors (names as in the unsharded model)."""
    out: dict[str, torch.Tensor] = {}
    heads, kv = m["heads"], m["kv_heads"]
    for name, t in hf_tensors.items():
        if m["arch"] == "gpt2":
            name = name.removeprefix("transformer.")
            if name.endswith(_GPT2_IGNORED):
                continue
            mapped = {
                "wte.weight": "tok_embed.weight",
                "wpe.weight": "pos_embed.weight",
                "ln_f.weight": "norm.weight",
                "ln_f.bias": "norm.bias",
                "lm_head.weight": "head.weight",
            }.get(name)
            if mapped:
                out[mapped] = t
                continue
            parts = name.split(".")
            if parts[0] != "h":
                raise HfFormatError(f"{where}: unexpected tensor {name!r} for gpt2")
            block, leaf = ".".join(parts[2:-1]), parts[-1]
            prefix = f"layers.{parts[1]}."
            if block == "attn.c_attn":
                # Conv1D [in, 3*hidden] (q | k | v along the output) -> three [out, in] linears.
                q, k, v = (t.t() if leaf == "weight" else t).chunk(3, dim=0)
                for short, part in (("wq", q), ("wk", k), ("wv", v)):
                    out[f"{prefix}attn.{short}.{leaf}"] = part.contiguous()
            elif block in _GPT2_BLOCK:
                conv = leaf == "weight" and not block.startswith("ln")
                out[f"{prefix}{_GPT2_BLOCK[block]}.{leaf}"] = t.t().contiguous() if conv else t
            else:
                raise HfFormatError(f"{where}: unexpected tensor {name!r} for gpt2")
            continue
        mapped = {
            "model.embed_tokens.weight": "tok_embed.weight",
            "model.norm.weight": "norm.weight",
            "lm_head.weight": "head.weight",
        }.get(name)
        if mapped:
            out[mapped] = t
            continue
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or ".".join(parts[3:-1]) not in _LLAMA_BLOCK:
            if name.endswith("rotary_emb.inv_freq"):  # a buffer some exporters save
                continue
            raise HfFormatError(f"{where}: unexpected tensor {name!r} for a llama-family model")
        short = _LLAMA_BLOCK[".".join(parts[3:-1])]
        if short == "attn.wq":
            t = _to_interleaved(t, heads)
        elif short == "attn.wk":
            t = _to_interleaved(t, kv)
        out[f"layers.{parts[2]}.{short}.{parts[-1]}"] = t
    if m["tie_embeddings"]:
        out.pop("head.weight", None)  # a tied head is the embedding (some files store both)
    return out


def to_hf(tensors: dict[str, torch.Tensor], m: dict) -> dict[str, torch.Tensor]:
    """threefold logical tensors -> Hugging Face tensors (the inverse of from_hf)."""
    out: dict[str, torch.Tensor] = {}
    gpt2 = m["arch"] == "gpt2"
    top = (
        {
            "tok_embed.weight": "transformer.wte.weight",
            "pos_embed.weight": "transformer.wpe.weight",
            "norm.weight": "transformer.ln_f.weight",
            "norm.bias": "transformer.ln_f.bias",
            "head.weight": "lm_head.weight",
        }
        if gpt2
        else {
            "tok_embed.weight": "model.embed_tokens.weight",
            "norm.weight": "model.norm.weight",
            "head.weight": "lm_head.weight",
        }
    )
    gpt2_block = {v: k for k, v in _GPT2_BLOCK.items()}
    llama_block = {v: k for k, v in _LLAMA_BLOCK.items()}
    fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name in top:
            out[top[name]] = t
            continue
        parts = name.split(".")
        layer, short, leaf = parts[1], ".".join(parts[2:-1]), parts[-1]
        if gpt2:
            if short in ("attn.wq", "attn.wk", "attn.wv"):
                fused.setdefault((layer, leaf), {})[short] = t
            else:
                conv = leaf == "weight" and "norm" not in short
                out[f"transformer.h.{layer}.{gpt2_block[short]}.{leaf}"] = t.t().contiguous() if conv else t
            continue
        if short == "attn.wq":
            t = _to_halves(t, m["heads"])
        elif short == "attn.wk":
            t = _to_halves(t, m["kv_heads"])
        out[f"model.layers.{layer}.{llama_block[short]}.{leaf}"] = t
    for (layer, leaf), qkv in fused.items():
        cat = torch.cat([qkv["attn.wq"], qkv["attn.wk"], qkv["attn.wv"]], dim=0)
        out[f"transformer.h.{layer}.attn.c_attn.{leaf}"] = cat.t().contiguous() if leaf == "weight" else cat
    return out
