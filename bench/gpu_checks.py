"""bench/gpu.py's correctness checks: threefold's code paths on the device against CPU fp32
references, one guarded row each (a failure of any kind is that row's FAIL, never the run's end).

Tolerances, from what the arithmetic allows (u = 2^-24 and 2^-8 are the unit roundoffs of fp32
and bf16; one fp32 ulp at 1 is 2u):
  reordered fp32 sums   a length-n reduction in any order (CUDA's split-K, tree or atomic sums,
                        inductor's fused reductions, FMA contraction) is within about sqrt(n) u of
                        the exact sum, relative to the sum of |terms| (Higham & Mary 2019,
                        probabilistic rounding analysis); two orders differ by twice that, and the
                        relative errors of the reductions a value passes through in sequence add:
                        bound = 2u * sum(sqrt(n_i)) over that chain (`reordered_bound`).
  attention fp32        that bound over the chain of the query gradient: QK^T (head dim d),
                        the softmax sum and PV (sequence s), then dP = dO V^T and the rowsum of
                        dO*O (d), dQ = dS K (s): 8.6e-6 at d = 64, s = 256, relative to max |ref|.
  attention bf16        q, k, v rounded to bf16, the probabilities rounded before PV, the output
                        rounded: five roundings of at most u each, relative to max |ref|: 5 * 2^-8.
  adamw                 each step rounds every parameter twice (the decay product, the update's
                        subtraction; the fused kernel may contract them with FMA), at most half
                        an ulp of |p| each in each implementation: 2 ulps per step between two;
                        the update itself (about lr) differs by a few ulps of lr, a small
                        fraction of |p|'s ulp. The decay factor 1 - lr*wd < 1 does not amplify
                        a carried difference, so differences add per step: 4 ulps (a factor 2
                        over the sum) times the steps, relative to max |p|.
  train fp32 / recompute / compile   the relative loss difference: the reordered bound over the
                        model's forward chain (per block: norm, QKV, scores, softmax, PV, output
                        projection, norm, MLP in and out; then the final norm, the head, the
                        log-sum-exp over the vocabulary and the mean over the step's tokens),
                        times the steps: step k's loss sees k - 1 updates, and AdamW's
                        normalized update turns a gradient's relative error into the update's.
                        Recompute replays the same kernels (bit-identical on CPU), but CUDA's
                        attention backward and cuBLAS may pick another order: the same bound.
  train bf16            bf16 weights and activations against fp32: round-to-nearest errors are
                        unbiased, so a reduction's result keeps a relative error of order u
                        (bf16), not n u, the norm after every residual add rescales instead of
                        accumulating, and each step's update adds its own: steps * 2^-8,
                        relative to the loss (a step's own loss change is ~10% on the tiny model,
                        so a missing or wrong update still fails).

THREEFOLD_GPU_BENCH_FAIL=<key>[,<key>...] (test-only) makes each named check or phase raise before
it measures, so the failure path is exercised without a broken GPU. Check keys: attention_<backend>
_<bf16|fp32>[_hd128], fused_attention, adamw, adamw_fused, train_fp32, train_bf16,
recompute_selective, recompute_full, train_compile, perf_threefold, perf_memory, perf_plain.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

TINY = {"model.preset": "tiny", "model.seq_len": 128, "train.global_batch": 8, "train.micro_batch": 4}
U32, U16 = 2.0**-24, 2.0**-8
BF16_TOL = 5 * U16
FUSED = ("flash", "efficient")
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
ADAMW_STEPS = 5
ADAMW_TOL = 4 * ADAMW_STEPS * 2 * U32
TRAIN_STEPS = 3
FAIL_ENV = "THREEFOLD_GPU_BENCH_FAIL"
# SDPA's refusals of a backend for a dtype/shape/device: CUDA's sdp_utils says "No available
# kernel", the CPU dispatcher (torch 2.13) "No viable backend for scaled_dot_product_attention".
REFUSALS = ("No available kernel", "No viable backend for scaled_dot_product_attention")
# Exit codes of a worker stopped by SIGINT / SIGTERM (threefold.training.signals): the bench stops too.
SIGNAL_EXITS = (130, 143)


def reordered_bound(lengths: list[int]) -> float:
    """Relative difference two summation orders may show after a chain of reductions of these
    lengths (module docstring)."""
    return 2 * U32 * sum(math.sqrt(n) for n in lengths)


def forward_chain(m, tokens: int) -> list[int]:
    """Reduction lengths a loss passes through in sequence: per block norm, QKV (h), scores
    (head dim), softmax sum and PV (s), output projection, norm, MLP in (h), MLP out (ffn);
    then the final norm and head (h), the log-sum-exp (vocab) and the mean over the tokens."""
    block = [m.hidden, m.hidden, m.head_dim, m.seq_len, m.seq_len, m.hidden, m.hidden, m.hidden, m.ffn_hidden]
    return block * m.layers + [m.hidden, m.hidden, m.vocab, tokens]


def first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def check(name: str, value: float, tolerance: float, key: str | None = None) -> dict:
    row = {"check": name, "value": value, "tolerance": tolerance, "ok": bool(value <= tolerance)}
    return {**row, "key": key} if key else row


def forced(key: str) -> None:
    """The test-only failure hook (module docstring)."""
    if key in {k.strip() for k in os.environ.get(FAIL_ENV, "").split(",")}:
        raise AssertionError(f"forced failure of {key} ({FAIL_ENV}, test-only)\nunset {FAIL_ENV} to measure")


def guarded(key: str, label: str, tolerance: float | None, measure, refused=lambda err: False) -> dict:
    """check(label, measure(), tolerance); any exception (or a worker's exit) is this row's FAIL
    with its first line, except where `refused(err)`: "not served" (passes, value None)."""
    row = {"check": label, "key": key, "value": None, "tolerance": tolerance}
    try:
        forced(key)
        value = measure()
        if tolerance is None:  # a measurement, not a comparison
            return {**row, "value": value, "ok": True}
        return check(label, value, tolerance, key)
    except Exception as err:  # noqa: BLE001 - any failure is the check's verdict, not the script's
        if refused(err):
            return {**row, "ok": True, "note": "not served"}
        return {**row, "ok": False, "note": first_line(err)}
    except SystemExit as err:  # run_worker exits on a user error or a failed peer
        if err.code in SIGNAL_EXITS:
            raise
        return {**row, "ok": False, "note": f"SystemExit: the worker exited with code {err.code}"}


def sdpa_refused(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(refusal in str(err) for refusal in REFUSALS)


def backend_check(label: str, tolerance: float, measure, key: str | None = None) -> dict:
    """guarded() where SDPA refusing the backend is "not served", not a failure."""
    return guarded(key or label.replace(" ", "_"), label, tolerance, measure, sdpa_refused)


def fused_requirement(outcomes: list[dict], device: str) -> dict:
    """At least one fused backend (flash, efficient) must serve bf16 at head dim 128 within
    tolerance on CUDA: without one, attention runs on the math kernel (seq^2 memory, slow) and
    a `sdpa_kernel` list that allows math would hide it. `outcomes` are the per-backend checks;
    on other devices the outcome is reported and passes."""
    served = [o for o in outcomes if o["value"] is not None]
    good = [o for o in served if o["ok"]]
    row = {
        "check": "fused attention served (bf16 hd128, flash or efficient)",
        "key": "fused_attention",
        "value": min((o["value"] for o in served), default=None),
        "tolerance": BF16_TOL,
    }
    if device != "cuda":
        return {**row, "ok": True, "note": f"required on cuda only; {len(good)} of {len(outcomes)} served"}
    if good:
        return {**row, "ok": True, "note": ", ".join(o["check"].split()[1] for o in good)}
    return {
        **row,
        "ok": False,
        "note": "no fused backend served within tolerance" if served else "no fused backend served",
    }


def attention_checks(device: str, emit) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from threefold.model.layers import AttentionCore

    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    core = AttentionCore()

    def run(inputs, dtype, dev, backend):
        qq, kk, vv = (t.to(dev, dtype).clone().requires_grad_() for t in inputs)
        with sdpa_kernel([backend]):  # this backend alone: a refusal raises instead of falling back
            out = core(qq, kk, vv)
            out.float().square().sum().backward()
        return out.float().cpu(), qq.grad.float().cpu()

    def error(inputs, ref, dtype, backend) -> float:
        """max |out - ref| and max |dq - ref dq|, relative to max |ref|."""
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
        out, dq = run(inputs, dtype, device, backend)
        return max(rel(out, ref[0]), rel(dq, ref[1]))

    gen = torch.Generator().manual_seed(0)
    d, s = 64, 256
    gqa = [torch.randn(2, h, s, d, generator=gen) for h in (8, 2, 2)]  # 8 query heads, 2 kv heads
    mha = [torch.randn(2, 8, s, 128, generator=gen) for _ in range(3)]  # head dim 128, no GQA
    refs = {}

    def ref(name, inputs):
        if name not in refs:
            refs[name] = run(inputs, torch.float32, "cpu", SDPBackend.MATH)
        return refs[name]

    fp32_tol = reordered_bound([d, s, s, d, d, s])
    for dtype, tol, short in ((torch.bfloat16, BF16_TOL, "bf16"), (torch.float32, fp32_tol, "fp32")):
        for name, backend in backends.items():
            measure = lambda dtype=dtype, backend=backend: error(gqa, ref("gqa", gqa), dtype, backend)  # noqa: E731
            emit(backend_check(f"attention {name} {str(dtype)[6:]}", tol, measure, f"attention_{name}_{short}"))
    fused = []
    for name in FUSED:
        measure = lambda name=name: error(mha, ref("mha", mha), torch.bfloat16, backends[name])  # noqa: E731
        fused.append(backend_check(f"attention {name} bf16 hd128", BF16_TOL, measure, f"attention_{name}_bf16_hd128"))
        emit(fused[-1])
    try:
        forced("fused_attention")
        emit(fused_requirement(fused, device))
    except Exception as err:  # noqa: BLE001 - the forced failure, or a malformed outcome
        label = "fused attention served (bf16 hd128, flash or efficient)"
        row = {"check": label, "key": "fused_attention", "value": None, "tolerance": BF16_TOL}
        emit({**row, "ok": False, "note": first_line(err)})


def adamw_case(device: str):
    """(p0, per-step gradients, the reference after every step): torch.optim.AdamW on the CPU in
    fp32, one decayed and one undecayed group as the engine splits matrices from norms/biases."""
    import torch

    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(ADAMW_STEPS)]
    decayed, plain = torch.nn.Parameter(p0[:600].clone()), torch.nn.Parameter(p0[600:].clone())
    opt = torch.optim.AdamW([{"params": [decayed]}, {"params": [plain], "weight_decay": 0.0}], foreach=True, **ADAMW)
    for g in grads:
        decayed.grad, plain.grad = g[:600].clone(), g[600:].clone()
        opt.step()
    return p0, grads, torch.cat([decayed.detach(), plain.detach()])


def adamw_foreach_error(device: str, case) -> float:
    """threefold's adamw_update (the engine's foreach path) on the device: max |p - ref| / max |ref|."""
    import torch

    from threefold.distributed.data_parallel.adamw import adamw_update

    p0, grads, ref = case
    p = p0.clone().to(device)
    m, s = torch.zeros_like(p), torch.zeros_like(p)
    for i, g in enumerate(grads):
        adamw_update([p], [g.to(device)], [m], [s], [p[:600]], i + 1, ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], 0.1)
    return ((p.cpu() - ref).abs().max() / ref.abs().max()).item()


def adamw_fused_error(device: str, case) -> float:
    """torch._fused_adamw_ as the engine calls it (threefold's fused_adamw_update: views of one
    flat buffer grouped by decay, the step count a device tensor, the gradients divided by a
    device scale, a skip flag), with one skipped step in the middle that must change nothing:
    max |p - ref| / max |ref|."""
    import torch

    from threefold.distributed.data_parallel.adamw import fused_adamw_update

    p0, grads, ref = case
    dev = torch.device(device)
    p = p0.clone().to(dev)
    m, s = torch.zeros_like(p), torch.zeros_like(p)
    step = torch.zeros((), device=dev)
    scale = torch.full((), 4.0, device=dev)  # a power of two: dividing the scaled gradient is exact
    schedule = [(g, 0.0) for g in grads[:2]] + [(grads[2] * 1e3, 1.0)] + [(g, 0.0) for g in grads[2:]]
    for g, skip in schedule:
        g = (g * 4.0).to(dev)
        found_inf = torch.full((), skip, device=dev)
        step += 1
        groups = [
            ([p[:600]], [g[:600]], [m[:600]], [s[:600]], ADAMW["weight_decay"]),
            ([p[600:]], [g[600:]], [m[600:]], [s[600:]], 0.0),
        ]
        fused_adamw_update(groups, step, ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], scale, found_inf)
        step -= found_inf  # a skipped step does not count (as the engine does)
    return ((p.cpu() - ref).abs().max() / ref.abs().max()).item()


def adamw_checks(device: str, emit) -> None:
    case = []

    def shared():
        if not case:
            case.append(adamw_case(device))
        return case[0]

    foreach = lambda: adamw_foreach_error(device, shared())  # noqa: E731
    fused = lambda: adamw_fused_error(device, shared())  # noqa: E731
    emit(guarded("adamw", "adamw foreach (engine arithmetic)", ADAMW_TOL, foreach))
    emit(guarded("adamw_fused", "adamw fused (torch._fused_adamw_)", ADAMW_TOL, fused))


def make_cfg(overrides: dict, device: str, dtype: str, steps: int, log_dir: str, cache_dir: str, **extra):
    from threefold.config import build_config
    from threefold.validate import validate

    pairs = {
        **({"train.warmup_steps": 1} if overrides.get("model.preset") == "tiny" else {}),  # presets: their paper's
        **overrides,
        "train.device": device,
        "train.dtype": dtype,
        "train.steps": steps,
        "log.dir": log_dir,
        "log.quiet": "true",
        # No saves: a gpt-1.3b checkpoint is ~16 GB (fp32 master + two moments), fsynced and hashed.
        "checkpoint.dir": "",
        "data.cache_dir": cache_dir,
        "data.prefetch": 0,
        **extra,
    }
    return validate(build_config(None, [(k, str(v)) for k, v in pairs.items()]), 1)


def train_metrics(
    overrides: dict, device: str, dtype: str, steps: int, cache_dir: str, log_dir: str = "", callbacks=None, **extra
) -> list[dict]:
    """threefold's own training worker, in this process (world of 1), logging into `log_dir` (a
    temporary one unless given), with the library's `callbacks`. The worker sets the process's
    intra-op threads on CPU (train.threads); they are restored after it, and its process group is left even when it
    fails, so the next run can join one."""
    import torch

    from threefold.distributed.runtime import shutdown_distributed
    from threefold.training.worker import run_worker

    threads = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory() as scratch:
            logs = log_dir or scratch
            cfg = make_cfg(overrides, device, dtype, steps, logs, cache_dir, **extra)
            run_worker(cfg.to_dict(), callbacks=callbacks)
            return [json.loads(line) for line in (Path(logs) / "metrics.jsonl").read_text().splitlines()]
    finally:
        shutdown_distributed()
        torch.set_num_threads(threads)


def relative_loss_diff(a: list[dict], b: list[dict]) -> float:
    """max over steps of |loss_a - loss_b| / |loss_b|."""
    if len(a) != len(b) or not a:
        raise AssertionError(f"{len(a)} steps against {len(b)}")
    return max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b))


class TinyRuns:
    """The tiny model's runs that several checks compare with, each made once on first use; a
    failed run fails every check that needs it, with the run's first line."""

    def __init__(self, device: str, cache_dir: str):
        self.device, self.cache_dir, self._done = device, cache_dir, {}

    def get(self, name: str, device: str, dtype: str = "fp32", **extra) -> list[dict]:
        if name not in self._done:
            try:
                self._done[name] = train_metrics(TINY, device, dtype, TRAIN_STEPS, self.cache_dir, **extra)
            except (Exception, SystemExit) as err:  # noqa: BLE001 - recorded, raised to each user below
                if isinstance(err, SystemExit) and err.code in SIGNAL_EXITS:
                    raise
                self._done[name] = err
        got = self._done[name]
        if isinstance(got, BaseException):
            raise RuntimeError(f"the {name} run failed: {first_line(got)}")
        return got

    def reference(self) -> list[dict]:
        return self.get("cpu fp32 reference", "cpu")

    def eager(self) -> list[dict]:
        if self.device == "cpu":  # the reference itself
            return self.reference()
        return self.get(f"{self.device} fp32", self.device)

    def fp32_bound(self) -> float:
        from threefold.config import build_config

        cfg = build_config(None, [(k, str(v)) for k, v in TINY.items()])
        tokens = cfg.train.global_batch * cfg.model.seq_len
        return TRAIN_STEPS * reordered_bound(forward_chain(cfg.model, tokens))


def training_checks(runs: TinyRuns, emit) -> None:
    dev, bound = runs.device, runs.fp32_bound()
    fp32 = lambda: relative_loss_diff(runs.eager(), runs.reference())  # noqa: E731
    emit(guarded("train_fp32", "train fp32 vs CPU fp32", bound, fp32))
    emit(
        guarded(
            "train_bf16",
            "train bf16 + fp32 master vs CPU fp32",
            TRAIN_STEPS * U16,
            lambda: relative_loss_diff(runs.get(f"{dev} bf16", dev, "bf16"), runs.reference()),
        )
    )
    for mode in ("selective", "full"):
        measure = lambda mode=mode: relative_loss_diff(  # noqa: E731
            runs.get(f"{dev} recompute {mode}", dev, **{"train.recompute": mode}), runs.eager()
        )
        emit(guarded(f"recompute_{mode}", f"recompute {mode} vs none", bound, measure))


def compile_check(runs: TinyRuns, emit) -> None:
    dev = runs.device
    emit(
        guarded(
            "train_compile",
            "train.compile vs eager (fp32)",
            runs.fp32_bound(),
            lambda: relative_loss_diff(runs.get(f"{dev} compiled", dev, **{"train.compile": "true"}), runs.eager()),
        )
    )
