"""PLACEHOLDER (helper H6 replaces this file): the Prometheus endpoint per node."""


class Exporter:
    def __init__(self, cfg, grid, is_logger: bool):
        pass

    def update(self, record: dict, findings: list) -> None:
        """Every rank, every step, after the diagnosis (`findings`: rank 0's active ones)."""

    def close(self) -> None:
        pass
