"""PLACEHOLDER (helper H2 replaces this file): per-layer time on traced steps and the slow-layer
detector."""


class LayerClock:
    def __init__(self, chunks, cfg, grid, device, is_logger: bool):
        pass

    def begin_step(self, step: int) -> None:
        """`step` counts from 0 (every rank, every step)."""

    def end_step(self, step: int) -> tuple[dict, dict | None]:
        """Every rank, every step once its spans are closed (collective over the world on traced
        steps only): (fields for the metrics line, rank 0's per-layer table for the ReportView or
        None)."""
        return {}, None


def detector(cfg, grid):
    return None
