"""The Prometheus endpoint per node (log.prometheus_port): where cluster monitoring already looks.

The first rank of each node (LOCAL_RANK 0) serves http://<host>:<port + node>/metrics from a
registry of its own (prometheus_client's CollectorRegistry, not the process-global one), with
prometheus_client's threaded server. Node i (torchrun's GROUP_RANK) serves log.prometheus_port + i,
so that nodes sharing one host (torchrun agents on localhost) do not collide: on a cluster, scrape
host i at port + i. A taken port is one stderr line; the run goes on without that endpoint.

    threefold_step                  the last step read (counted from 1, as metrics.jsonl)
    threefold_step_time_seconds     that step's wall time on this rank
    threefold_tokens_per_second     the run's tokens per second at that step
    threefold_mfu                   model FLOPs utilisation at that step
    threefold_loss                  that step's loss
    threefold_category_share{category}    the step's share per span category, on report steps
                                          (the node of rank 0: every rank's means, as the bands)
    threefold_finding{kind,key}           1 while the diagnosis names it (rank 0's node)
    threefold_finding_since_step{kind,key}    the step it was first seen in
    threefold_slow_link_wait_seconds{link}    a named slow link's wait per step or micro-batch
    threefold_change_point_step{category,key} the step a named change started

A finding's series are removed when the diagnosis clears it, so `threefold_finding` holds only
what is active. update() sets a few gauges from the record the rank already has: no
communication, no per-step cost beyond that.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from threefold.errors import ConfigError
from threefold.observe.findings import Finding

INSTALL = "pip install 'threefold[prometheus]' (prometheus-client)"


def require_client(port: int) -> None:
    """One ConfigError line when log.prometheus_port asks for an endpoint the package cannot serve."""
    if port and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(
            "log.prometheus_port", f"{port} needs the prometheus-client package, which is not installed", INSTALL
        )


def node_of(rank: int, environ=None) -> int:
    """This rank's node: the elastic agent's GROUP_RANK (one agent per node), else
    rank // LOCAL_WORLD_SIZE, else 0 (as preflight/nodes.py counts, which this floor cannot import)."""
    env = os.environ if environ is None else environ
    if "GROUP_RANK" in env:
        return int(env["GROUP_RANK"])
    local = int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
    return rank // local if local > 0 else 0


def share_of(record: dict) -> dict[str, float]:
    """Each category's share of the step from a report record: per category the ranks' mean
    seconds over the ranks' mean step wall time ({} off report steps and with spans off)."""
    means = (record.get("time_s") or {}).get("mean")
    wall = (record.get("span_step_s") or {}).get("mean") or 0.0
    if not means or wall <= 0:
        return {}
    return {c: s / wall for c, s in means.items()}


class Exporter:
    """One node's endpoint; a no-op on every other rank and with log.prometheus_port 0."""

    def __init__(self, cfg, grid, is_logger: bool, environ=None):
        env = os.environ if environ is None else environ
        log = cfg.log
        self.port = int(getattr(log, "prometheus_port", 0) or 0)
        self.host = getattr(log, "prometheus_host", "0.0.0.0")
        self.server = None
        self._findings: dict[tuple[str, str], Finding] = {}
        if not self.port or int(env.get("LOCAL_RANK", 0)) != 0:
            return
        require_client(self.port)
        self.node = node_of(grid.global_rank, env)
        self._build()
        port = self.port + self.node
        from prometheus_client import start_http_server

        try:
            self.server, self._thread = start_http_server(port, addr=self.host, registry=self.registry)
        except OSError as err:
            # Monitoring must not end a training run: a taken port is named and the run goes on.
            print(
                f"threefold: log.prometheus_port: cannot serve node {self.node} on {self.host}:{port} "
                f"({err.strerror or err}); no Prometheus endpoint on this node",
                file=sys.stderr,
                flush=True,
            )
            return
        if is_logger and not getattr(log, "quiet", False):
            print(
                f"threefold: Prometheus metrics on http://{self.host}:{port}/metrics (node i: port {self.port}+i)",
                file=sys.stderr,
                flush=True,
            )

    def _build(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        r = self.registry = CollectorRegistry(auto_describe=True)
        self.step = Gauge("threefold_step", "The last step read, counted from 1", registry=r)
        self.step_time = Gauge("threefold_step_time_seconds", "Wall time of the last step on this rank", registry=r)
        self.tokens = Gauge("threefold_tokens_per_second", "Tokens per second at the last step", registry=r)
        self.mfu = Gauge("threefold_mfu", "Model FLOPs utilisation at the last step (0..1)", registry=r)
        self.loss = Gauge("threefold_loss", "Loss of the last step", registry=r)
        self.share = Gauge(
            "threefold_category_share",
            "Share of the step per span category, ranks' means on the last report step",
            ["category"],
            registry=r,
        )
        self.finding = Gauge(
            "threefold_finding", "1 while the in-run diagnosis names this finding", ["kind", "key"], registry=r
        )
        self.since = Gauge(
            "threefold_finding_since_step", "The step a named finding was first seen in", ["kind", "key"], registry=r
        )
        self.link_wait = Gauge(
            "threefold_slow_link_wait_seconds", "A named slow link's measured wait", ["link"], registry=r
        )
        self.change_step = Gauge(
            "threefold_change_point_step", "The step a named change in the run started", ["category", "key"], registry=r
        )

    def update(self, record: dict, findings: list[Finding]) -> None:
        """Every rank, every step, after the diagnosis (`findings`: rank 0's active ones, [] on
        the other ranks): set this node's gauges from the step's record."""
        if self.server is None:
            return
        self.step.set(record["step"])
        self.step_time.set(record["step_time_s"])
        self.tokens.set(record["tokens_per_s"])
        self.mfu.set(record["mfu"])
        if record.get("loss") is not None:
            self.loss.set(record["loss"])
        for category, share in share_of(record).items():
            self.share.labels(category).set(share)
        self._set_findings(findings)

    def _set_findings(self, findings: list[Finding]) -> None:
        active = {f.identity: f for f in findings}
        for identity in self._findings.keys() - active.keys():
            self._drop(self._findings[identity])
        for f in active.values():
            self.finding.labels(f.kind, f.key).set(1)
            self.since.labels(f.kind, f.key).set(f.since)
            if f.kind == "slow_link":
                self.link_wait.labels(f.key).set(f.value)
            elif f.kind == "change":
                self.change_step.labels(f.category or "step_time", f.key).set(f.since)
        self._findings = active

    def _drop(self, f: Finding) -> None:
        """A cleared finding's series go: Prometheus then marks them stale."""
        self.finding.remove(f.kind, f.key)
        self.since.remove(f.kind, f.key)
        if f.kind == "slow_link":
            self.link_wait.remove(f.key)
        elif f.kind == "change":
            self.change_step.remove(f.category or "step_time", f.key)

    def close(self) -> None:
        """Stop serving (the run's end, or a stop): the port is free for a restarted attempt."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
