"""Every cross-field rule of the configuration, in one place.

Each violation raises ConfigError naming the key, what is wrong and what would be valid; the
CLI turns it into one line on stderr and exit code 2.
"""

from __future__ import annotations

from threefold.config import Config
from threefold.errors import ConfigError


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _divides(key: str, what: str, value: int, by_key: str, by: int, valid: str) -> None:
    if value % by:
        raise ConfigError(key, f"{what} ({value}) is not divisible by {by_key} ({by})", valid)


def _divisors(n: int) -> str:
    return "valid: " + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def validate_arch(cfg: Config) -> None:
    """A built-in architecture, or a user model whose build function imports and returns a
    ModelSpec (model/custom.py); a user model's head is its own, so nothing ties it."""
    m = cfg.model
    if ":" not in m.arch:
        if m.arch not in ("llama", "gpt2"):
            raise ConfigError(
                "model.arch", f"{m.arch!r} is not allowed", "valid: llama, gpt2, or module:function (your own model)"
            )
        return
    from threefold.model.custom import spec_of

    spec = spec_of(m)
    if cfg.train.recompute == "selective" and not spec.selective:
        raise ConfigError(
            "train.recompute", f"selective needs {m.arch}'s ModelSpec.selective patterns", "valid: none, full"
        )
    if m.tie_embeddings:
        raise ConfigError("model.tie_embeddings", f"not supported for a user model ({m.arch})", "set it to false")
    if getattr(cfg.data, "document_mask", False):  # its blocks take no document layout
        raise ConfigError("data.document_mask", f"not supported for a user model ({m.arch})", "set it to false")


def validate_model(cfg: Config) -> None:
    validate_arch(cfg)
    m = cfg.model
    for key in ("hidden", "layers", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len"):
        _positive(f"model.{key}", getattr(m, key))
    _divides("model.hidden", "model.hidden", m.hidden, "model.heads", m.heads, "hidden must be heads * head_dim")
    if m.head_dim % 2 and m.arch == "llama":
        raise ConfigError("model.hidden", f"head_dim {m.head_dim} must be even for rotary embeddings")
    _divides(
        "model.kv_heads",
        "model.heads",
        m.heads,
        "model.kv_heads",
        m.kv_heads,
        "each kv head serves a whole group of query heads",
    )
    if m.arch == "gpt2" and m.kv_heads != m.heads:
        raise ConfigError("model.kv_heads", "gpt2 uses plain multi-head attention", f"set it to {m.heads}")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError("model.dropout", f"{m.dropout} is outside [0, 1)")
    validate_moe(cfg)


def validate_moe(cfg: Config) -> None:
    """Mixture-of-experts shape; ep's own rules are in validate_parallel."""
    m = cfg.model
    _positive("model.num_experts", m.num_experts, allow_zero=True)
    if m.num_experts == 0:
        return
    _positive("model.top_k", m.top_k)
    _positive("model.moe_every", m.moe_every)
    if m.top_k > m.num_experts:
        raise ConfigError(
            "model.top_k", f"{m.top_k} is more than model.num_experts ({m.num_experts})", f"valid: 1 to {m.num_experts}"
        )
    if m.moe_every > m.layers:
        raise ConfigError(
            "model.moe_every",
            f"{m.moe_every} is more than model.layers ({m.layers}): no block would be MoE",
            f"valid: 1 to {m.layers}",
        )
    for key in ("capacity_factor", "aux_loss_coeff", "z_loss_coeff"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}", f"must be >= 0, got {getattr(m, key)}")


def _valid_tp(cfg: Config) -> list[int]:
    """Tensor-parallel sizes the model's shape can be split by."""
    m = cfg.model
    return [
        t
        for t in range(1, m.heads + 1)
        if m.heads % t == 0
        and (m.kv_heads % t == 0 or t % m.kv_heads == 0)
        and m.vocab % t == 0
        and m.ffn_hidden % t == 0
    ]


def resolve_dp(cfg: Config, world_size: int | None) -> None:
    """parallel.dp = 0 fills the world given by torchrun."""
    p = cfg.parallel
    if p.dp == 0:
        if world_size is None:
            raise ConfigError("parallel.dp", "0 (auto) needs a world size from torchrun", "set dp explicitly")
        inner = p.tp * p.pp * p.cp
        if world_size % inner:
            raise ConfigError("parallel.dp", f"world size {world_size} is not divisible by tp*pp*cp = {inner}")
        p.dp = world_size // inner


def validate_parallel(cfg: Config, world_size: int | None) -> None:
    m, p = cfg.model, cfg.parallel
    for key in ("tp", "pp", "ep", "cp", "vpp"):
        _positive(f"parallel.{key}", getattr(p, key))
    _positive("parallel.dp", p.dp, allow_zero=True)
    resolve_dp(cfg, world_size)
    validate_context_parallel(cfg)
    if p.tp > 1:
        valid = "valid: " + ", ".join(map(str, _valid_tp(cfg)))
        _divides("parallel.tp", "model.heads", m.heads, "parallel.tp", p.tp, valid)
        if m.kv_heads % p.tp and p.tp % m.kv_heads:
            raise ConfigError(
                "parallel.tp",
                f"model.kv_heads ({m.kv_heads}) and parallel.tp ({p.tp}) must divide "
                "one another (kv heads are split, or shared by tp/kv_heads ranks)",
                valid,
            )
        _divides(
            "parallel.tp",
            "model.vocab",
            m.vocab,
            "parallel.tp",
            p.tp,
            f"pad model.vocab to a multiple of {p.tp}; {valid}",
        )
        _divides("parallel.tp", "model.ffn_hidden", m.ffn_hidden, "parallel.tp", p.tp, valid)
    if p.sp and p.tp == 1:
        raise ConfigError(
            "parallel.sp", "sequence parallelism needs tensor parallelism", "set parallel.tp > 1 or sp false"
        )
    if p.sp:  # the sequence is split over cp first, then over tp
        what = "model.seq_len" if p.cp == 1 else "seq_len/cp"
        _divides("parallel.sp", what, m.seq_len // p.cp, "parallel.tp", p.tp, "seq_len must split evenly over tp")
    _positive("parallel.bucket_mb", p.bucket_mb)
    if p.zero3_prefetch < 1:
        raise ConfigError(
            "parallel.zero3_prefetch", f"must be >= 1 block ahead, got {p.zero3_prefetch}", "e.g. 1 (default) or 2"
        )
    if p.grad_reduce == "every" and p.zero < 2:
        raise ConfigError(
            "parallel.grad_reduce",
            "every micro-batch needs ZeRO 2 or 3 (an all-reduce of ZeRO 0/1 "
            f"would add each micro-batch's gradients again; parallel.zero is {p.zero})",
            "valid: overlap or after, or parallel.zero 2/3",
        )
    if p.dp % p.ep:
        raise ConfigError(
            "parallel.ep",
            f"ep ({p.ep}) does not divide dp ({p.dp})",
            "experts are carved out of data-parallel ranks: " + _divisors(p.dp),
        )
    if p.ep > 1 and m.num_experts == 0:
        raise ConfigError("parallel.ep", f"{p.ep} needs a mixture-of-experts model", "set model.num_experts or ep 1")
    if m.num_experts and m.num_experts % p.ep:
        raise ConfigError(
            "parallel.ep",
            f"model.num_experts ({m.num_experts}) is not divisible by ep ({p.ep})",
            "each expert-parallel rank holds an equal share: " + _divisors(m.num_experts),
        )
    if m.num_experts and p.tp > 1:
        # The MoE layers split their tokens over the TP ranks (experts are not tensor-sharded).
        what = "model.seq_len" if p.cp == 1 else "seq_len/cp"
        _divides("parallel.tp", what, m.seq_len // p.cp, "parallel.tp", p.tp, "MoE layers split the sequence over tp")
    _checkpoint_keys(cfg)
    world = p.dp * p.tp * p.pp * p.cp
    if world_size is not None and world != world_size:
        raise ConfigError(
            "parallel",
            f"dp*tp*pp*cp = {p.dp}*{p.tp}*{p.pp}*{p.cp} = {world} but torchrun started {world_size} processes",
            "make the product equal the world size, or set parallel.dp 0",
        )


def validate_context_parallel(cfg: Config) -> None:
    """parallel.cp: the zigzag layout (2cp chunks, rank i holding i and 2cp-1-i) on every rank, and
    what each attention variant and the rest of the model can serve."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return
    if ":" in m.arch:  # a user model's attention is its own: nothing swaps in the cp kernel
        raise ConfigError("parallel.cp", f"{p.cp} is not supported for a user model ({m.arch})", "valid: 1")
    if cfg.data.document_mask:
        raise ConfigError("data.document_mask", f"not supported with context parallelism (cp {p.cp})", "set it false")
    _divides("model.seq_len", "model.seq_len", m.seq_len, "2*parallel.cp", 2 * p.cp, "a multiple of 2*cp")
    if m.num_experts and m.capacity_factor > 0:  # the capacity queue runs in token order
        raise ConfigError("model.capacity_factor", f"must be 0 (dropless) with cp {p.cp}", "set it to 0")
    for key, heads in (("heads", m.heads), ("kv_heads", m.kv_heads)) if p.cp_impl == "a2a" else ():
        local, ring = max(1, heads // p.tp), "a2a splits the TP-local heads over cp; or use parallel.cp_impl ring"
        _divides("parallel.cp", f"a2a: model.{key}/tp", local, "parallel.cp", p.cp, ring)


def _checkpoint_keys(cfg: Config) -> None:
    c = cfg.checkpoint
    if c.resume == "auto" and not c.dir:
        raise ConfigError(
            "checkpoint.resume",
            "'auto' looks for checkpoints in checkpoint.dir, which is empty",
            "set --checkpoint.dir DIR or resume from a path",
        )
    if c.interval and not c.dir:
        raise ConfigError("checkpoint.interval", f"{c.interval} needs checkpoint.dir", "set --checkpoint.dir DIR")
    if c.async_save and not c.dir:
        raise ConfigError("checkpoint.async", "true needs checkpoint.dir", "set --checkpoint.dir DIR")
    if c.keep < 0:
        raise ConfigError("checkpoint.keep", f"must be >= 0, got {c.keep}")
    for key in ("interval", "memory_interval"):
        value = getattr(c, key)
        if value != "auto" and value < 0:
            raise ConfigError(f"checkpoint.{key}", f"must be >= 0 or auto, got {value}")
    if c.mtbf_h < 0:
        raise ConfigError("checkpoint.mtbf_h", f"must be >= 0 (0 = the planner's default), got {c.mtbf_h}")


def validate_train(cfg: Config) -> None:
    t, p = cfg.train, cfg.parallel
    _positive("train.steps", t.steps)
    _positive("train.global_batch", t.global_batch)
    _positive("train.lr", t.lr)
    _positive("train.warmup_steps", t.warmup_steps, allow_zero=True)
    _positive("train.threads", t.threads)
    _positive("train.timeout_s", t.timeout_s)
    _positive("train.startup_timeout_s", t.startup_timeout_s)
    if t.startup_timeout_s < t.timeout_s:
        raise ConfigError(
            "train.startup_timeout_s",
            f"{t.startup_timeout_s:g} is shorter than train.timeout_s ({t.timeout_s:g})",
            "valid: >= train.timeout_s",
        )
    _positive("train.max_restarts", t.max_restarts, allow_zero=True)
    _positive("train.preempt_grace_s", t.preempt_grace_s)
    _positive("train.nan_rollback_after", t.nan_rollback_after, allow_zero=True)
    _positive("train.straggler_steps", t.straggler_steps, allow_zero=True)
    if t.on_slow not in ("warn", "exclude", "rebalance"):
        raise ConfigError("train.on_slow", f"{t.on_slow!r} is not allowed", "valid: warn, exclude, rebalance")
    _positive("train.on_slow_reports", t.on_slow_reports)
    if t.preflight not in ("auto", "on", "off"):
        raise ConfigError("train.preflight", f"{t.preflight!r} is not allowed", "valid: auto, on, off")
    if t.preflight_exclude and t.preflight == "off":
        # The exclusion acts on the node probe's finding: with the probes off there is none.
        raise ConfigError(
            "train.preflight_exclude",
            "needs the node probe, but train.preflight is off",
            "valid: train.preflight auto or on",
        )
    _positive("train.recompute_layers", t.recompute_layers, allow_zero=True)
    if t.dtype == "fp16" and t.loss_scale == "none":
        raise ConfigError(
            "train.loss_scale",
            "fp16 training without loss scaling underflows gradients",
            "valid: auto, dynamic, a number, or train.dtype bf16",
        )
    from threefold.distributed.data_parallel import MixedPrecision

    _positive("train.initial_loss_scale", t.initial_loss_scale)
    _positive("train.loss_scale_window", t.loss_scale_window)
    MixedPrecision.from_names(
        "fp32" if t.dtype == "auto" else t.dtype,
        t.grad_reduce_dtype,
        t.loss_scale,
        t.initial_loss_scale,
        t.loss_scale_window,
    )
    if t.recompute_layers and t.recompute != "full":
        raise ConfigError(
            "train.recompute_layers",
            f"{t.recompute_layers} applies only to full recompute (train.recompute is {t.recompute!r})",
            "set train.recompute full or recompute_layers 0",
        )
    if t.recompute_layers > cfg.model.layers:
        raise ConfigError(
            "train.recompute_layers",
            f"{t.recompute_layers} is more than model.layers ({cfg.model.layers})",
            f"valid: 0 (all) to {cfg.model.layers}",
        )
    _validate_compile(cfg)
    _validate_eval(cfg)
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError("train.min_lr_ratio", f"{t.min_lr_ratio} is outside [0, 1]")
    _divides(
        "train.global_batch",
        "train.global_batch",
        t.global_batch,
        "parallel.dp",
        p.dp,
        "each data-parallel rank takes an equal share",
    )
    per_rank = t.global_batch // p.dp
    if p.microbatches > 0:
        _divides(
            "parallel.microbatches",
            "global_batch/dp",
            per_rank,
            "parallel.microbatches",
            p.microbatches,
            _divisors(per_rank),
        )
        t.micro_batch = per_rank // p.microbatches
    else:
        _positive("train.micro_batch", t.micro_batch)
        _divides(
            "train.micro_batch", "global_batch/dp", per_rank, "train.micro_batch", t.micro_batch, _divisors(per_rank)
        )
        p.microbatches = per_rank // t.micro_batch
    if cfg.log.interval <= 0:
        raise ConfigError("log.interval", f"must be > 0, got {cfg.log.interval}")
    validate_log(cfg)


def _validate_compile(cfg: Config) -> None:
    """Inductor builds CPU kernels with a C++ compiler: without one the first step would fail deep
    inside torch.compile."""
    import shutil

    t = cfg.train
    if not (t.compile and t.compile_backend == "inductor") or t.device == "cuda":
        return
    if t.device == "auto":
        import torch

        if torch.cuda.is_available():
            return
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        raise ConfigError(
            "train.compile",
            "inductor on CPU needs a C++ compiler (g++, c++ or clang++) on PATH",
            "install one, or set train.compile_backend aot_eager or train.compile false",
        )


def _validate_eval(cfg: Config) -> None:
    t, d = cfg.train, cfg.data
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError("data.val_fraction", f"{d.val_fraction} is outside [0, 1)", "e.g. 0.01")
    _positive("train.eval_every", t.eval_every, allow_zero=True)
    _positive("train.eval_sequences", t.eval_sequences, allow_zero=True)
    if t.eval_every and d.val_fraction == 0:
        raise ConfigError(
            "train.eval_every",
            f"{t.eval_every} needs held-out tokens, but data.val_fraction is 0",
            "set e.g. --data.val_fraction 0.01",
        )


def validate_log(cfg: Config) -> None:
    """'auto' trace steps become one late step; trace steps parse and need spans; TensorBoard
    output needs the package."""
    import importlib.util

    from threefold.observe.observer import TRACE_AUTO, TRACE_AUTO_MAX_WORLD, auto_trace_step, parse_trace_steps

    log, p = cfg.log, cfg.parallel
    if log.trace_steps.strip() == TRACE_AUTO:
        # The default names no number: it becomes one here, where train.steps is known, so the
        # workers' observer reads a plain step; without spans there is nothing to trace (no error).
        small = p.tp * p.cp * p.dp * p.pp <= TRACE_AUTO_MAX_WORLD
        log.trace_steps = str(auto_trace_step(cfg.train.steps, log.interval)) if log.spans and small else ""
    try:
        steps = parse_trace_steps(log.trace_steps)
    except ValueError:
        raise ConfigError(
            "log.trace_steps",
            f"{log.trace_steps!r} is not a list of step numbers",
            "e.g. '5,6' (steps count from 1), 'auto', or '' for none",
        ) from None
    if steps and not log.spans:
        raise ConfigError("log.trace_steps", "needs log.spans true", "set --log.spans true")
    if steps and max(steps) > cfg.train.steps:
        raise ConfigError(
            "log.trace_steps",
            f"step {max(steps)} is past train.steps ({cfg.train.steps})",
            f"valid: 1..{cfg.train.steps}",
        )
    if log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "log.tensorboard",
            "the tensorboard package is not installed",
            "pip install 'threefold[tensorboard]' or set log.tensorboard false",
        )
    if not 0 <= log.change_min <= 10:
        raise ConfigError("log.change_min", f"{log.change_min} is out of range", "a fraction such as 0.2, or 0 for off")
    if log.slow_ratio != 0 and not 1 < log.slow_ratio <= 100:
        raise ConfigError("log.slow_ratio", f"{log.slow_ratio} is out of range", "a multiple above 1, or 0 for off")
    if not 0 <= log.prometheus_port <= 65535:
        raise ConfigError("log.prometheus_port", f"{log.prometheus_port} is not a port", "1..65535, or 0 for none")
    from threefold.observe.prometheus import require_client

    require_client(log.prometheus_port)


def validate_pipeline(cfg: Config) -> None:
    """Stages need layers, the schedule needs enough micro-batches (after they are resolved)."""
    from threefold.distributed.pipeline.partition import parse_stage_layers
    from threefold.distributed.pipeline.schedules import check_args

    m, p = cfg.model, cfg.parallel
    stages = p.pp * p.vpp
    if stages > m.layers:
        raise ConfigError(
            "parallel.vpp" if p.vpp > 1 else "parallel.pp",
            f"pp*vpp = {stages} virtual stages but model.layers is {m.layers}",
            "each virtual stage needs at least one layer",
        )
    if p.stage_layers:
        parse_stage_layers(p.stage_layers, m.layers, stages)
    check_args(p.schedule, p.pp, p.microbatches, p.vpp)


def validate_document_mask(cfg: Config) -> None:
    """data.document_mask needs an end-of-document id (a user model is refused in validate_arch)."""
    if not cfg.data.document_mask:
        return
    from threefold.data.documents import document_separator

    document_separator(cfg.data.tokenizer)


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Check and resolve derived fields (dp when 0, micro-batch split) in place."""
    validate_model(cfg)
    validate_parallel(cfg, world_size)
    validate_train(cfg)
    validate_pipeline(cfg)
    validate_document_mask(cfg)
    return cfg
