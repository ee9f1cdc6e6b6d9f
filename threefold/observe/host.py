"""What this host is: CPU model, physical memory, the cores this process may use. Torch-free, so
the planner reads the host without importing torch."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo, else platform.processor(), else the machine type."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def total_ram_bytes() -> int | None:
    """The host's physical memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's share), not the
    host's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
