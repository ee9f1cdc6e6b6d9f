"""The planner: predict memory, step time and MFU of a layout, and search the best one.

    shape = model_shape(cfg.model)                       # from a threefold Config's model section
    cluster = build_cluster({"device": "h100", "nodes": 4})
    plan = search(shape, cluster, global_batch=512)      # ranked Predictions + rejections
    pred = predict(shape, cluster, parse_layout("tp=8,pp=2", cluster.world), 512)

Model of memory and time, its assumptions and calibration: docs/planner.md.
"""

from threefold.planner.calibrate import Calibration, fit, load_run
from threefold.planner.cluster import PROFILES, Cluster, build_cluster
from threefold.planner.cost import CATEGORIES, bubble_ratio, step_terms
from threefold.planner.faults import Faults, advise, daly_interval, goodput, young_interval
from threefold.planner.layout import Layout, parse_layout, structural_reason
from threefold.planner.memory import (
    device_memory,
    expert_dp,
    inflight,
    layer_activation_bytes,
    model_state_bytes,
    moe_layer_activation_bytes,
)
from threefold.planner.model import ModelShape, model_shape, split_layers
from threefold.planner.predict import Prediction, predict
from threefold.planner.search import Plan, search

__all__ = [
    "CATEGORIES",
    "PROFILES",
    "Calibration",
    "Cluster",
    "Faults",
    "Layout",
    "ModelShape",
    "Plan",
    "Prediction",
    "advise",
    "bubble_ratio",
    "build_cluster",
    "daly_interval",
    "device_memory",
    "expert_dp",
    "fit",
    "goodput",
    "inflight",
    "layer_activation_bytes",
    "load_run",
    "model_shape",
    "model_state_bytes",
    "moe_layer_activation_bytes",
    "parse_layout",
    "predict",
    "search",
    "split_layers",
    "step_terms",
    "structural_reason",
    "young_interval",
]
