"""`threefold plan`: search the best layout, evaluate one, or calibrate on measured runs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
from pathlib import Path

from threefold.errors import ConfigError

USAGE = """threefold plan [--config FILE] --train.global_batch N [--model.KEY V ...] [--cluster.KEY V ...]
                      [--layout SPEC] [--json] [--top N] [--emit-config FILE] [--faults.KEY V ...]
                      [--topology FILE [--placement-out FILE]] [--spares auto|N [--batch-within PCT]]
       threefold plan --calibrate RUN_DIR [RUN_DIR ...] [--validate RUN_DIR ...] [--cluster.KEY V ...]
                      [--fit PARAM,PARAM] [--save-profile FILE] [--json]
  e.g. threefold plan --model.preset llama-70b --cluster.device h100 --cluster.nodes 16 --train.global_batch 1024
       threefold plan --model.preset gpt-175b --cluster.device a100-80gb --cluster.nodes 240 \\
                      --train.global_batch 1920 --layout tp=8,pp=16,dp=15,vpp=3,mbs=1,zero=1,sp=true,recompute=selective
  --parallel.{tp,pp,dp,vpp,zero,sp,schedule,ep}, --train.micro_batch and --train.recompute pin that
  dimension of the search. threefold plan --help-cluster lists the cluster and faults keys."""

# Config keys that, when given, pin one dimension of the search.
PIN_KEYS = {
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.dp": "dp",
    "parallel.vpp": "vpp",
    "parallel.zero": "zero",
    "parallel.sp": "sp",
    "parallel.schedule": "schedule",
    "parallel.ep": "ep",
    "parallel.cp": "cp",
    "parallel.cp_impl": "cp_impl",
    "parallel.zero3_prefetch": "zero3_prefetch",
    "train.micro_batch": "mbs",
    "train.recompute": "recompute",
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="threefold plan", usage=USAGE, add_help=True)
    ap.add_argument("--config", help="TOML config with the [model] (and [train]) of the run to plan")
    ap.add_argument("--layout", help="evaluate this layout instead of searching, e.g. tp=8,pp=4,mbs=1,zero=1")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    ap.add_argument("--emit-config", metavar="FILE", help="write the best (or given) layout as a train config")
    ap.add_argument("--calibrate", nargs="+", metavar="RUN_DIR", help="fit the cluster's parameters to these runs")
    ap.add_argument(
        "--validate",
        nargs="+",
        metavar="RUN_DIR",
        default=[],
        help="with --calibrate: runs to compare against the fit without fitting on them",
    )
    ap.add_argument("--fit", help="with --calibrate: comma-separated parameters to fit (default: chosen automatically)")
    ap.add_argument("--warmup", type=int, default=None, help="with --calibrate: steps to drop per run (default 1/5)")
    ap.add_argument("--save-profile", metavar="FILE", help="with --calibrate: write the fitted cluster profile")
    ap.add_argument(
        "--topology", metavar="FILE", help="place the layout on this topology (planner/topology.py) and price its links"
    )
    ap.add_argument(
        "--placement-out", metavar="FILE", help="with --topology: write the hosts in node-rank order (JSON)"
    )
    ap.add_argument(
        "--launch-out",
        metavar="DIR",
        help="with --topology and --emit-config: write hostfile, launch.sbatch (and jobset.json) in placement order",
    )
    ap.add_argument("--launch-image", metavar="IMAGE", help="with --launch-out: the container image of jobset.json")
    ap.add_argument(
        "--spares",
        metavar="auto|N",
        help="keep hot spare nodes: auto weighs 0 to 2%% of the nodes by throughput x goodput (planner/spares.py)",
    )
    ap.add_argument(
        "--batch-within",
        metavar="PCT",
        type=float,
        default=5.0,
        help="with --spares: a node count the global batch does not split trains the nearest batch within "
        "PCT%% of it that one of its layouts does (default 5; 0 keeps the batch)",
    )
    ap.add_argument("--help-cluster", action="store_true", help="list the cluster and faults keys")
    return ap


def _split(pairs: list[tuple[str, str]]) -> tuple[list, list, list]:
    cluster, faults, config = [], [], []
    for key, value in pairs:
        section, _, name = key.partition(".")
        if section == "cluster":
            cluster.append((name, value))
        elif section == "faults":
            faults.append((name, value))
        else:
            config.append((key, value))
    return cluster, faults, config


def _file_keys(path: str | None) -> set[str]:
    if not path:
        return set()
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return set()  # build_config reports the problem
    return {f"{s}.{k}" for s, table in data.items() if isinstance(table, dict) for k in table}


def plan_command(argv: list[str]) -> int:
    args, rest = _parser().parse_known_args(argv)
    from threefold.config import parse_overrides

    if args.help_cluster:
        from threefold.planner.cluster import describe
        from threefold.planner.faults import Faults

        print(describe())
        print("[faults]")
        for name, f in Faults.__dataclass_fields__.items():
            print(f"  faults.{name} = {f.default!r}  # {f.metadata.get('doc', '')}")
        return 0
    if args.top < 1:
        raise ConfigError("--top", f"must be >= 1, got {args.top}")
    cluster_pairs, fault_pairs, config_pairs = _split(parse_overrides(rest))
    from threefold.planner.cluster import build_cluster

    if args.calibrate:
        return _calibrate(args, build_cluster(cluster_pairs), {k for k, _ in cluster_pairs})
    for flag in ("validate", "fit", "save_profile"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag.replace('_', '-')}", "only applies with --calibrate RUN_DIR ...")
    return _plan(args, cluster_pairs, fault_pairs, config_pairs)


def _plan(args, cluster_pairs, fault_pairs, config_pairs) -> int:
    from threefold.config import build_config
    from threefold.planner import report
    from threefold.planner.cluster import build_cluster
    from threefold.planner.emit import layout_config, write_config
    from threefold.planner.faults import advise, build_faults
    from threefold.planner.layout import parse_layout, structural_reason
    from threefold.planner.model import model_shape
    from threefold.planner.overlap import overlap_lines, param_gather
    from threefold.planner.predict import predict
    from threefold.planner.search import Plan, oom_sentence, search
    from threefold.planner.validation import split_note
    from threefold.validate import validate_model

    cfg = build_config(args.config, config_pairs)
    validate_model(cfg)
    given = {k for k, _ in config_pairs} | _file_keys(args.config)
    if "train.global_batch" not in given:
        raise ConfigError(
            "train.global_batch",
            "the planner needs the global batch (sequences per optimizer step)",
            "e.g. --train.global_batch 1024",
        )
    if cfg.train.global_batch < 1:
        raise ConfigError("train.global_batch", f"must be > 0, got {cfg.train.global_batch}")
    # The run config's placement keys describe the cluster too, unless --cluster.* says otherwise.
    named = {k for k, _ in cluster_pairs}
    for key in ("devices_per_node", "allow_tp_across_nodes"):
        if f"parallel.{key}" in given and key not in named and getattr(cfg.parallel, key):
            cluster_pairs = [*cluster_pairs, (key, getattr(cfg.parallel, key))]
    if cfg.train.grad_reduce_dtype in ("bf16", "fp16") and "grad_reduce" not in named:
        cluster_pairs = [*cluster_pairs, ("grad_reduce", "16bit")]  # the run's reduction, unless --cluster says
    if "param_gather" not in named:  # ZeRO 1/2's gather as the engine runs it (parallel.overlap_param_gather)
        cluster_pairs = [*cluster_pairs, ("param_gather", param_gather(cfg.parallel.overlap_param_gather))]
    topo = admit = None
    if args.topology:
        from threefold.planner.placement_plan import cluster_pairs as topology_pairs
        from threefold.planner.placement_plan import placement_check
        from threefold.planner.topology import read_topology

        topo = read_topology(args.topology)
        cluster_pairs = [*cluster_pairs, *topology_pairs(topo, named)]
        admit = placement_check(topo)  # the search keeps only layouts the topology places
    for flag, value in (("--placement-out", args.placement_out), ("--launch-out", args.launch_out)):
        if value and not args.topology:
            raise ConfigError(flag, "needs --topology FILE to place the layout on")
    if args.launch_out and not args.emit_config:
        raise ConfigError("--launch-out", "needs --emit-config FILE: the launch scripts train that config")
    cluster = build_cluster(cluster_pairs, cache_dir=cfg.data.cache_dir)
    faults = build_faults(fault_pairs)
    dtype = cfg.train.dtype if cfg.train.dtype != "auto" else ("fp32" if cluster.device == "cpu" else "bf16")
    shape = model_shape(cfg.model)
    B = cfg.train.global_batch
    pins = {PIN_KEYS[k]: _pin_value(cfg, k) for k in given if k in PIN_KEYS}
    if pins.get("dp") == 0:
        pins.pop("dp")

    spare_lines, restart = [], None
    if args.spares is not None:
        if args.layout:
            raise ConfigError(
                "--spares", "chooses the nodes the layout runs on; drop --layout", "--spares auto with a search"
            )
        if args.spares != "auto" and not (args.spares.isdigit() and int(args.spares) < cluster.nodes):
            raise ConfigError("--spares", f"{args.spares!r} is not auto or a count below {cluster.nodes} nodes")
        from threefold.planner.faults import recovery_s
        from threefold.planner.spares import best_option, candidates, spare_options

        if not 0 <= args.batch_within < 100:
            raise ConfigError("--batch-within", f"{args.batch_within:g} is not a percentage in [0, 100)")
        counts = candidates(cluster.nodes, args.spares)
        within = args.batch_within / 100
        options = spare_options(shape, cluster, B, dtype, faults, counts, pins, within, 1, admit)
        chosen = best_option(options)
        if chosen is None:
            raise ConfigError("--spares", f"no layout runs on {cluster.nodes} nodes less any spare count weighed")
        spare_lines = [f"spares: {chosen.text()}"]
        spare_lines += [f"  instead: {o.text()}" for o in options if o is not chosen and o.prediction]
        if none := [o.spares for o in options if not o.prediction]:
            spare_lines.append(
                f"  no layout of the model and batch on the nodes {len(none)} other counts leave: {none}"
            )
        cluster = dataclasses.replace(cluster, nodes=chosen.nodes)
        B = cfg.train.global_batch = chosen.batch  # the batch chosen with the nodes (and --emit-config's)
        restart = recovery_s(faults, chosen.spares, chosen.nodes, cluster.devices_per_node)
    if args.layout:
        layout = parse_layout(args.layout, cluster.world)
        why = structural_reason(
            cfg.model, layout, B, cluster.devices_per_node, cluster.allow_tp_across_nodes, cluster.world
        )
        if why:
            raise ConfigError("--layout", why[1].rstrip("."))
        pred = predict(shape, cluster, layout, B, dtype)
        plan = Plan(shape, cluster, B, dtype, [pred], {}, 1, 0.0)
        if not pred.fits:
            note = oom_sentence(pred.memory, pred.usable_bytes, cluster)
        else:
            note = None
    else:
        plan = search(shape, cluster, B, dtype, pins=pins, keep=max(args.top, 1), admit=admit)
        if not plan.ranked:
            raise ConfigError("plan", _nothing_fits(plan) + _batch_hint(plan, pins, args.spares is None))
        pred, note = plan.best, None
    placed = None
    if topo is not None:
        from threefold.planner.placement_plan import placement_doc, rerank, write_placement

        reranked = []
        if not args.layout:  # the layout the placement makes fastest, of those the table shows
            pred, reranked = rerank(plan.ranked[: max(args.top, 1)], shape, cluster, B, dtype, topo)
        placed = placement_doc(shape, cluster, pred.layout, B, dtype, topo)
        placed["layout"] = pred.layout.spec()
        if reranked:
            placed["reranked"] = reranked
        if args.placement_out:
            write_placement(args.placement_out, placed)
    advice = advise(
        faults,
        pred.devices_used,
        max(1, -(-pred.devices_used // cluster.devices_per_node)),
        shape.total_params,
        pred.step_time_s,
        dtype,
        restart,
    )
    emitted = None
    if args.emit_config:
        run_cfg = layout_config(
            cfg,
            pred.layout,
            cluster.devices_per_node,
            cluster.allow_tp_across_nodes,
            cluster.device,
            dtype,
            advice.interval_steps,
        )
        head = (
            f"threefold plan: {report.header(shape, cluster, B, dtype)}\n"
            f"predicted: step {pred.step_time_s:.4g} s, MFU {pred.mfu:.1%}, "
            f"{pred.memory.total / 2**30:.1f} GiB per device; layout {pred.layout.spec()}\n"
            f"checkpoint every {advice.interval_steps} steps (Young's interval, {advice.interval_s / 60:.1f} min): "
            f"checkpoint.dir = DIR, checkpoint.interval = {advice.interval_steps}"
        )
        emitted = str(write_config(args.emit_config, run_cfg, head))
    if args.json:
        doc = report.plan_json(plan, args.top, advice, emitted)
        if note:
            doc["layouts"][0]["rejected"] = note
        if placed:
            doc["placement"] = placed
        if spare_lines:
            doc["spares"] = spare_lines
        print(json.dumps(doc, indent=1))
    elif args.layout:
        print(report.header(shape, cluster, B, dtype))
        print(report.describe_prediction(pred, cluster))
        print("\n".join(overlap_lines(cluster)))
        print("  " + split_note(cluster.validation, [k for k, v in pred.times.items() if v > 0]))
        print("  faults: " + advice.sentence())
        if note:
            print("  does not fit: " + note)
        if emitted:
            print(f"wrote {emitted}")
    else:
        print(report.plan_text(plan, args.top, advice))
        if emitted:
            print(f"\nwrote {emitted}: threefold train --config {emitted}")
    if spare_lines and not args.json:
        print("\n".join(spare_lines))
    if placed and not args.json:
        from threefold.planner.placement_plan import placement_lines

        print("\n".join(placement_lines(placed)))
        if args.placement_out:
            print(f"wrote {args.placement_out}: hosts in node-rank order (torchrun --node-rank k on hosts[k])")
    if placed and args.launch_out:
        from threefold.planner.launch_scripts import write_launch

        paths = write_launch(
            args.launch_out, placed["hosts"], cluster.devices_per_node, emitted, args.launch_image or ""
        )
        if not args.json:
            print("wrote " + ", ".join(paths) + ("" if args.launch_image else " (jobset.json: give --launch-image)"))
    return 0


def _pin_value(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _nothing_fits(plan) -> str:
    mem = plan.rejected.get("memory")
    where = f"{getattr(plan.shape.cfg, 'preset', '') or 'the model'} on {plan.cluster.label()}"
    if mem and mem.examples:
        spec, sentence = mem.best()[0]
        return (
            f"no layout of {where} fits: the smallest, {spec}, {sentence[0].lower()}{sentence[1:].rstrip('.')} "
            "(add devices, or use devices with more memory)"
        )
    if plan.rejected:
        kind, rej = max(plan.rejected.items(), key=lambda kv: kv[1].count)
        spec, sentence = rej.best()[0]
        return f"no layout of {where} is possible: e.g. {spec}: {sentence.rstrip('.')}"
    return f"no layout of {where} is possible"


def _batch_hint(plan, pins, spares_off: bool) -> str:
    """When the global batch is what no layout of the cluster's nodes splits: the nearest batch
    that one does (within 25%), and --spares auto, which leaves nodes out instead."""
    from threefold.planner.spares import nearest_plan

    if "batch" not in plan.rejected:
        return ""
    near, batch = nearest_plan(plan.shape, plan.cluster, plan.global_batch, plan.dtype, pins, within=0.25)
    nodes = f"the {plan.cluster.nodes:,} nodes"
    other = f"; a global batch of {batch:,} splits over {nodes}" if near is not None and near.ranked else ""
    return other + ("; or --spares auto leaves nodes out as spares" if spares_off else "")


def _calibrate(args, base, explicit: set[str]) -> int:
    from threefold.planner.calibrate import fit, load_run
    from threefold.planner.cluster import profile_toml
    from threefold.planner.report import calibration_text

    runs = [load_run(p, args.warmup) for p in args.calibrate]
    held = [load_run(p, args.warmup) for p in args.validate]
    free = [s.strip() for s in args.fit.split(",") if s.strip()] if args.fit else None
    cal = fit(runs, base, free, held, explicit)
    if args.save_profile:
        note = "fitted by threefold plan --calibrate " + " ".join(args.calibrate)
        Path(args.save_profile).write_text(profile_toml(cal.cluster, note, cal.bands()), encoding="utf-8")
    if args.json:
        print(json.dumps(cal.as_dict(), indent=1))
    else:
        print(calibration_text(cal))
        if args.save_profile:
            print(f"wrote {args.save_profile}: use it with --cluster.profile {args.save_profile}")
    return 0
