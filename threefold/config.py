"""Typed run configuration: dataclass sections, model presets, TOML + command-line overrides.

Every field carries a one-line doc (``knob(default, doc)``) that `threefold train --help-config`
prints. Validation of cross-field rules lives in `threefold.validate`, in one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from threefold.errors import ConfigError
from threefold.presets import PRESET_TRAIN, PRESETS


def knob(default: Any, doc: str, choices: tuple | None = None, key: str | None = None, words: tuple = ()) -> Any:
    """A config field with its one-line doc (and optional allowed values). `key` is the name
    in TOML and on the command line when the field's own name cannot be it (a Python keyword).
    `words`: strings a number field also takes (checkpoint.interval auto)."""
    return field(default=default, metadata={"doc": doc, "choices": choices, "key": key, "words": words})


@dataclass
class ModelConfig:
    """Transformer shape. `preset` fills every shape field the user did not set."""

    preset: str = knob("tiny", "Named model size whose shape fills the other fields", None)
    arch: str = knob(
        "llama",
        "llama: RMSNorm/RoPE/SwiGLU/GQA; gpt2: LayerNorm/GeLU/learned positions; or your own model as "
        "module:function (or file.py:function) returning a threefold.ModelSpec (docs/library.md)",
    )
    hidden: int = knob(0, "Model width h (0 = from preset)")
    layers: int = knob(0, "Number of transformer blocks (0 = from preset)")
    heads: int = knob(0, "Attention (query) heads (0 = from preset)")
    kv_heads: int = knob(0, "Key/value heads for grouped-query attention (0 = same as heads)")
    ffn_hidden: int = knob(0, "MLP inner width (0 = from preset)")
    vocab: int = knob(0, "Vocabulary size of embedding and head (0 = from preset)")
    seq_len: int = knob(0, "Training sequence length (0 = from preset)")
    norm_eps: float = knob(1e-5, "Epsilon of RMSNorm/LayerNorm")
    rope_theta: float = knob(10000.0, "RoPE base frequency (llama)")
    dropout: float = knob(0.0, "Dropout on attention/MLP outputs (0 keeps layouts bit-comparable)")
    qkv_bias: bool = knob(False, "Biases on the q/k/v projections of llama (Qwen2-style); gpt2 always has biases")
    tie_embeddings: bool = knob(False, "Share the input embedding with the output head (gpt presets: true)")
    init_std: float = knob(0.02, "Std of the normal init; output projections get std/sqrt(2*layers)")
    num_experts: int = knob(0, "Routed experts per MoE layer (0 = dense MLPs everywhere)")
    top_k: int = knob(2, "Experts each token is routed to")
    moe_every: int = knob(1, "Every k-th block is MoE (layers k-1, 2k-1, ...); 1 = all blocks")
    capacity_factor: float = knob(
        0.0, "Expert capacity = factor * tokens * top_k / experts; overflow is dropped (0 = dropless)"
    )
    aux_loss_coeff: float = knob(0.01, "Weight of the Switch/GShard load-balancing loss")
    z_loss_coeff: float = knob(0.001, "Weight of the router z-loss (mean squared log-sum-exp of router logits)")
    shared_expert: bool = knob(False, "Add a dense MLP every token goes through beside the routed experts")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class ParallelConfig:
    """How the model is spread over devices (DP x CP x TP x PP, with EP carved out of DP)."""

    dp: int = knob(1, "Data-parallel degree (0 = fill the world under torchrun)")
    tp: int = knob(1, "Tensor-parallel degree (kept inside a node)")
    pp: int = knob(1, "Pipeline-parallel degree")
    sp: bool = knob(False, "Sequence parallelism in the tensor-parallel group (needs tp > 1)")
    zero: int = knob(0, "ZeRO stage 0-3: shard optimizer state / gradients / parameters over dp", (0, 1, 2, 3))
    ep: int = knob(1, "Expert-parallel degree: experts sharded over ep ranks carved out of dp")
    cp: int = knob(1, "Context-parallel degree: every sequence is split over cp ranks (zigzag chunks i, 2cp-1-i)")
    cp_impl: str = knob(
        "ring", "Context-parallel attention: ring (KV blocks rotate) or a2a (Ulysses heads all-to-all)", ("ring", "a2a")
    )
    vpp: int = knob(1, "Virtual pipeline chunks per rank (interleaved schedule)")
    schedule: str = knob("1f1b", "Pipeline schedule", ("gpipe", "1f1b", "interleaved", "zb"))
    stage_layers: str = knob("", "Layers per virtual pipeline stage, e.g. '3,4,4,3' ('' = balanced by cost)")
    microbatches: int = knob(0, "Micro-batches per step per dp rank (0 = global_batch / (dp * micro_batch))")
    order: str = knob(
        "tp-cp-ep-dp-pp", "Rank order, fastest-varying first (tp first keeps TP groups on neighbouring ranks)"
    )
    devices_per_node: int = knob(0, "Devices per node for placement checks (0 = local world size)")
    hostfile: str = knob(
        "",
        "Under torchrun: a new job seats its nodes in this file's order, one host per line, or the hosts "
        "then spares of threefold plan --placement-out JSON ('' = the rendezvous' order; nodes beyond the "
        "layout's wait as spares)",
    )
    allow_tp_across_nodes: bool = knob(False, "Permit a tensor-parallel group to span nodes")
    bucket_mb: float = knob(25.0, "Gradient bucket size in MiB for data-parallel reduction (ZeRO 3 reduces per block)")
    overlap_param_gather: bool = knob(
        True,
        "ZeRO 1/2: each bucket's parameter all-gather starts right after its optimizer update and the next "
        "forward waits only where it first uses the bucket (false: the whole gather inside the step)",
    )
    zero3_prefetch: int = knob(
        1, "ZeRO 3: blocks gathered ahead of the one computing; at most this + 1 blocks (and the root) whole at once"
    )
    grad_reduce: str = knob(
        "overlap",
        "When data-parallel gradients are reduced: overlap = bucket by bucket during the "
        "last micro-batch's backward; after = once backward has ended; every = after every "
        "micro-batch (ZeRO 2/3: one micro-batch of unreduced gradients alive)",
        ("overlap", "after", "every"),
    )
    tp_comm_overlap: bool = knob(
        True,
        "Run tensor-parallel backward's input-gradient all-reduce (reduce-scatter "
        "under SP) while the weight-gradient matmuls compute",
    )
    free_sent_outputs: bool = knob(
        True, "Free a pipeline stage's output once it is sent, keeping only its graph for backward"
    )


@dataclass
class TrainConfig:
    """The optimisation loop."""

    steps: int = knob(300, "Optimizer steps to run")
    seed: int = knob(0, "Seed of initialization and data order (layout-invariant)")
    global_batch: int = knob(16, "Sequences per optimizer step, over all data-parallel ranks")
    micro_batch: int = knob(4, "Sequences per micro-batch per rank")
    lr: float = knob(3e-3, "Peak learning rate")
    min_lr_ratio: float = knob(0.1, "Final learning rate of the cosine decay, as a fraction of lr")
    warmup_steps: int = knob(20, "Linear warm-up steps")
    weight_decay: float = knob(0.1, "AdamW decoupled weight decay (not applied to norms and biases)")
    beta1: float = knob(0.9, "AdamW beta1")
    beta2: float = knob(0.95, "AdamW beta2")
    grad_clip: float = knob(1.0, "Clip by global gradient norm (0 = off)")
    adamw: str = knob(
        "fused",
        "AdamW's kernel: fused = torch's fused AdamW (one pass per group; the skip decided on the device), "
        "foreach = torch.optim.AdamW's foreach arithmetic (its updates bit for bit)",
        ("fused", "foreach"),
    )
    dtype: str = knob(
        "auto",
        "Parameter/compute dtype: auto = fp32 on CPU, bf16 on CUDA; bf16/fp16 keep fp32 master weights and Adam state",
        ("auto", "fp32", "bf16", "fp16"),
    )
    grad_reduce_dtype: str = knob(
        "auto",
        "Dtype of gradient accumulation and data-parallel reduction (auto = fp32, Megatron's main grads)",
        ("auto", "fp32", "bf16", "fp16"),
    )
    loss_scale: str = knob("auto", "Loss scaling: auto (dynamic for fp16, none otherwise), none, dynamic, or a number")
    initial_loss_scale: float = knob(65536.0, "Starting value of a dynamic loss scale (halved at each overflow)")
    loss_scale_window: int = knob(1000, "Overflow-free steps in a row after which a dynamic loss scale doubles")
    recompute: str = knob(
        "none",
        "Activation recomputation: selective = attention core, full = whole blocks",
        ("none", "selective", "full"),
    )
    recompute_layers: int = knob(0, "Blocks per pipeline stage that full recompute covers, from the first (0 = all)")
    compile: bool = knob(
        False, "torch.compile each transformer block (parallel plumbing stays eager); the first step compiles"
    )
    compile_backend: str = knob(
        "inductor",
        "Backend of train.compile: inductor generates kernels; aot_eager only traces (checks the capture)",
        ("inductor", "aot_eager"),
    )
    device: str = knob("auto", "Device type: auto = cuda when available, else cpu", ("auto", "cpu", "cuda"))
    threads: int = knob(1, "Intra-op threads per worker on CPU")
    timeout_s: float = knob(300.0, "Collective timeout: a hung rank fails the job after this long")
    startup_timeout_s: float = knob(
        1800.0, "Collective timeout while a rank builds, resumes, compiles its first step or saves (>= timeout_s)"
    )
    max_restarts: int = knob(0, "Times the elastic agent restarts failed workers (they resume from checkpoint.dir)")
    preempt_grace_s: float = knob(
        30.0, "After SIGINT/SIGTERM, how long workers may take to save before they are killed"
    )
    nan_rollback_after: int = knob(
        3, "Reload the last checkpoint after this many non-finite steps in a row (0 = never)"
    )
    straggler_steps: int = knob(5, "Name a rank whose compute stays above 1.5x the median this many steps (0 = off)")
    on_slow: str = knob(
        "warn",
        "What a slow node or stage the in-run diagnosis names leads to: warn (a line and a record), exclude "
        "(the node, as a lost node: torchrun --nnodes MIN:MAX, --max-restarts > 0), rebalance (an uneven "
        "pipeline partition, applied at a restart)",
        ("warn", "exclude", "rebalance"),
    )
    on_slow_reports: int = knob(3, "Report intervals in a row a node or stage stays named before train.on_slow acts")
    faults: str = knob("", "Fault injection for drills, e.g. 'kill:rank=1:step=5' ($THREEFOLD_FAULT overrides)")
    preflight: str = knob(
        "auto",
        "Before step 1: the node and link probes (threefold doctor); auto = when the world spans more than one "
        "node (the stack fingerprint is always compared)",
        ("auto", "on", "off"),
    )
    allow_stack_mismatch: bool = knob(
        False, "Train on although ranks differ in torch, NCCL as loaded, CUDA, device model or threefold's source"
    )
    preflight_exclude: bool = knob(
        False,
        "Leave out at start the one node whose ranks the node probe names (torchrun --nnodes MIN:MAX, "
        "--max-restarts > 0, parallel.dp 0): it ends as a lost node, the rest re-form the job smaller; "
        "first attempt only, so the restarted world probes again but never excludes again",
    )
    eval_every: int = knob(0, "Validation loss on the held-out tokens every N steps (0 = off; needs data.val_fraction)")
    eval_sequences: int = knob(64, "Held-out sequences one evaluation reads (0 = every held-out window)")


@dataclass
class DataConfig:
    """Where tokens come from."""

    path: str = knob(
        "",
        "Text file or directory, raw .bin tokens, a Megatron indexed dataset (prefix, prefix.bin or its "
        "directory), or a blend '0.7 web/ 0.3 code/' / blend.toml ('' = Python stdlib source)",
    )
    vocab: int = knob(0, "Vocabulary size of a pre-tokenized .bin or indexed dataset (0 = tokenizer's / prepare's)")
    dtype: str = knob(
        "uint16", "Element type of a raw .bin file (an indexed dataset's .idx names its own)", ("uint16", "uint32")
    )
    cache_dir: str = knob("", "Token cache directory ('' = $THREEFOLD_CACHE or ~/.cache/threefold)")
    prefetch: int = knob(2, "Batches prepared ahead by the background prefetcher (0 = inline)")
    tokenizer: str = knob("", "tokenizer.json (tokenizers package) for text corpora and decoding ('' = byte-level)")
    val_fraction: float = knob(
        0.0, "Last fraction of the token stream held out for evaluation and never trained on (0 = train on all of it)"
    )
    document_mask: bool = knob(
        False,
        "Attend only within documents of a packed sequence (split at the end-of-document id), "
        "positions restarting per document",
    )


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    dir: str = knob("auto", "Checkpoint directory ('auto' = <log.dir>/checkpoints, none without a log.dir; '' = none)")
    interval: int = knob(
        0,
        "Save to dir every N steps (0 = only at the end when dir is set; auto = Young's interval from the run's "
        "measured save stall, restart cost and failures, re-chosen as they move)",
        words=("auto",),
    )
    memory_interval: int = knob(
        0,
        "Snapshot every rank's state into host RAM (shared memory that outlives a restarted worker) every N "
        "steps; a restart loads it and reads dir only when every copy is gone (0 = off; auto = Young's interval)",
        words=("auto",),
    )
    replicas: int = knob(
        1, "Copies of each memory snapshot kept on another node (over torch.distributed): survives a lost node", (0, 1)
    )
    mtbf_h: float = knob(
        0.0,
        "Prior hours between failures of the whole job for interval auto, updated by the run's own failures "
        "(0 = 50,000 device-hours / devices, the planner's default)",
    )
    resume: str = knob("", "'' = start fresh, 'auto' = newest verified checkpoint in dir (if any), or a path")
    keep: int = knob(3, "Keep the newest N checkpoints (0 = all); the newest verified one is never deleted")
    async_save: bool = knob(
        False, "Write checkpoints in the background; the loop pays only the copy to host memory", key="async"
    )
    init_from: str = knob(
        "",
        "Checkpoint whose model weights start a fresh run (e.g. from import-hf): optimizer, "
        "step and data start anew; unused when resume finds a checkpoint",
    )


@dataclass
class LogConfig:
    """Metrics and console output."""

    dir: str = knob("runs/latest", "Run directory for metrics.jsonl and run.json")
    interval: int = knob(
        10,
        "Report every N steps: the status line (when stdout is not a terminal), and the only steps that "
        "gather per-rank detail to rank 0 (stragglers, spans, expert load)",
    )
    quiet: bool = knob(False, "No per-step console output")
    spans: bool = knob(
        True,
        "Time every rank's step by category (compute, TP/PP/DP comm, bubble, ...): "
        "time_s in metrics.jsonl, per-rank spans.jsonl (on by default: bench/spans_overhead.py)",
    )
    trace_steps: str = knob(
        "auto",
        "Steps written to trace.json (Perfetto), e.g. '5,6', or '' for none; needs log.spans. 'auto': "
        "with spans on, the last report step before the last (the last, in a run of log.interval steps "
        "or fewer) in a job of at most 64 ranks: late, reporting anyway, clear of the final save; the first "
        "report has its timeline",
    )
    layer_times: bool = knob(
        True,
        "On traced steps (log.trace_steps) also time each layer's forward and backward per rank: "
        "layer_time_s in metrics.jsonl and the slow-layer finding (observe/layers.py)",
    )
    bands: str = knob(
        "",
        "TOML [bands] of expected step shares per category (threefold report --write-bands): named when "
        "left, on report steps; needs log.spans",
    )
    change_min: float = knob(
        0.2,
        "Smallest relative rise of step time the change-point detector names, with the step it started and "
        "what moved (observe/changepoint.py); 0 = off",
    )
    slow_ratio: float = knob(
        2.0,
        "A pipeline pair or collective group whose wait, or a rank whose own time, exceeds this multiple of its "
        "peers' median over a report window is named (slow link, rank or node: observe/links.py); 0 = off",
    )
    tensorboard: bool = knob(False, "Also write the metrics as TensorBoard scalars into log.dir (needs tensorboard)")
    prometheus_port: int = knob(
        0,
        "Serve step time, tokens/s, MFU, category shares and the diagnosis' findings for Prometheus at "
        "http://<host>:<port + node index>/metrics, from each node's first rank (nodes sharing a host do not "
        "collide); 0 = off; needs prometheus-client",
    )
    prometheus_host: str = knob("0.0.0.0", "Address the Prometheus endpoint binds (127.0.0.1: this host only)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Config:
        hints = typing.get_type_hints(cls)
        return cls(**{name: hints[name](**values) for name, values in data.items()})


SECTIONS = tuple(f.name for f in dataclasses.fields(Config))


def apply_train_preset(cfg: Config, explicit: set[str] = frozenset()) -> None:
    """Fill lr, min_lr_ratio and warmup_steps from the model preset's paper (PRESET_TRAIN) where
    the user did not set them (`explicit`: "train.<key>" names). Call after apply_preset."""
    recipe = PRESET_TRAIN.get(cfg.model.preset, {})
    t = cfg.train
    for key in ("lr", "min_lr_ratio", "warmup_steps"):
        if key in recipe and f"train.{key}" not in explicit:
            setattr(t, key, type(getattr(t, key))(recipe[key]))
    if "warmup_tokens" in recipe and "train.warmup_steps" not in explicit:
        tokens_per_step = max(1, t.global_batch * cfg.model.seq_len)
        t.warmup_steps = max(1, math.ceil(recipe["warmup_tokens"] / tokens_per_step))


def apply_preset(model: ModelConfig, explicit: set[str] = frozenset()) -> None:
    """Fill the shape fields the user did not set (`explicit`: "model.<key>" names given in
    the TOML file or on the command line) from the named preset. A value the user gave wins
    even when it equals the field's default (e.g. top_k 2 over a top-8 preset)."""
    if model.preset not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset {model.preset!r}", "valid: " + ", ".join(PRESETS))
    preset = PRESETS[model.preset]
    # An MHA preset (kv_heads == heads) stays MHA when only heads is overridden: its kv_heads
    # follows the new head count rather than keeping the old one (which need not divide it).
    follows = preset.get("kv_heads", preset.get("heads")) == preset.get("heads") and "model.heads" in explicit
    for key, value in preset.items():
        if key == "kv_heads" and follows and "model.kv_heads" not in explicit:
            model.kv_heads = 0
        elif f"model.{key}" not in explicit or getattr(model, key) == 0:  # 0 also means "from the preset"
            setattr(model, key, value)
    if model.kv_heads == 0:
        model.kv_heads = model.heads


def field_doc(section: str, key: str) -> str:
    f = _fields(section)[key]
    return f.metadata.get("doc", "")


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key") or f.name


def _fields(section: str) -> dict[str, dataclasses.Field]:
    """Fields of a section by their TOML/command-line key."""
    return {_key(f): f for f in dataclasses.fields(_section_type(section))}


def _section_type(section: str) -> type:
    return typing.get_type_hints(Config)[section]


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f"did you mean {close[0]!r}?" if close else "valid: " + ", ".join(options)


def _coerce(key: str, f: dataclasses.Field, raw: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, with a one-line error."""
    kind = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str}[f.type]
    if isinstance(raw, str) and raw in f.metadata.get("words", ()):
        return raw
    try:
        if kind is bool:
            if isinstance(raw, bool):
                value = raw
            elif str(raw).lower() in ("1", "true", "yes", "on"):
                value = True
            elif str(raw).lower() in ("0", "false", "no", "off"):
                value = False
            else:
                raise ValueError
        elif kind is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            value = int(raw)
        elif kind is float:
            value = float(raw)
        else:
            value = str(raw)
    except (TypeError, ValueError):
        words = f.metadata.get("words", ())
        hint = f"valid: a number or {', '.join(words)}" if words else ""
        raise ConfigError(key, f"{raw!r} is not a valid {kind.__name__}", hint) from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(key, f"{value!r} is not allowed", "valid: " + ", ".join(map(str, choices)))
    return value


def set_key(cfg: Config, dotted: str, raw: Any) -> None:
    """Set `section.key` from a raw value, refusing unknown keys with a suggestion."""
    if "." not in dotted:
        raise ConfigError(dotted, "keys are written section.key", "sections: " + ", ".join(SECTIONS))
    section, key = dotted.split(".", 1)
    if section not in SECTIONS:
        raise ConfigError(dotted, f"unknown section {section!r}", _did_you_mean(section, list(SECTIONS)))
    fields = _fields(section)
    if key not in fields:
        full = [f"{section}.{k}" for k in fields]
        hint = _did_you_mean(dotted, full + [f"{s}.{k}" for s in SECTIONS for k in _fields(s) if s != section])
        raise ConfigError(dotted, "unknown key", hint)
    setattr(getattr(cfg, section), fields[key].name, _coerce(dotted, fields[key], raw))


def read_toml_file(path: str, key: str) -> dict:
    """A TOML file's tables; a missing or malformed file is a ConfigError on `key`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key, f"file {path} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(key, f"{path} is not valid TOML: {err}") from None


def load_toml(cfg: Config, path: str) -> list[str]:
    """Set every key of the TOML file; returns their dotted names."""
    data = read_toml_file(path, "--config")
    keys = []
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"{path}: {section}", "top-level entries must be [section] tables", "sections: " + ", ".join(SECTIONS)
            )
        for key, value in values.items():
            set_key(cfg, f"{section}.{key}", value)
            keys.append(f"{section}.{key}")
    return keys


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """`--section.key value` or `--section.key=value` pairs, in order."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(arg, "expected --section.key VALUE", "e.g. --parallel.tp 2 --train.steps 50")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(arg[2:], "missing value")
            key, value = arg[2:], argv[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def build_config(config_file: str | None, overrides: list[tuple[str, str]]) -> Config:
    """Defaults <- TOML file <- command-line overrides <- preset shape and optimizer schedule
    for unset fields."""
    cfg = Config()
    explicit = set(load_toml(cfg, config_file)) if config_file else set()
    for key, value in overrides:
        set_key(cfg, key, value)
        explicit.add(key.lstrip("-").replace("-", "_"))
    apply_preset(cfg.model, explicit)
    apply_train_preset(cfg, explicit)
    if cfg.checkpoint.dir == "auto":  # beside the run's logs: a run can be resumed or sampled from
        cfg.checkpoint.dir = str(Path(cfg.log.dir) / "checkpoints") if cfg.log.dir else ""
    return cfg


def describe(section: str | None = None) -> str:
    """Every key with its default and doc, for --help-config."""
    lines = []
    for s in SECTIONS if section is None else (section,):
        lines.append(f"[{s}]")
        for f in dataclasses.fields(_section_type(s)):
            lines.append(f"  {s}.{_key(f)} = {f.default!r}  # {f.metadata.get('doc', '')}")
    return "\n".join(lines)
