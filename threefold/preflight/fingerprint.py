"""This rank's software and hardware stack, as one flat dict of strings: what `threefold doctor`
and every start of `threefold train` compare across ranks (stack.py).

Libraries are identified as loaded, not as installed: NCCL by the shared object this process
has mapped (its path in /proc/self/maps and the sha256 of its content) and by the version it
reports, since two wheels can install to one path and leave the metadata naming the other
(marin #7344: metadata 2.30.7, library loaded 2.28.9).

Every key has one of three kinds (`kind_of`):
- hard: a difference can make ranks compute or communicate differently; the run stops unless
  train.allow_stack_mismatch (torch, NCCL as loaded, threefold's source, CUDA, the device model);
- soft: a difference is named as a warning (environment, Python, other packages, memory,
  clocks, CPU);
- host: legitimately different from rank to rank and left out of every comparison (host name,
  pid, this rank's device, where the package lives, CUDA_VISIBLE_DEVICES: a launcher that gives
  each process its own GPU, as Slurm's --gpus-per-task does, sets a different one per rank; and
  the variables a launcher sets for its own workers, so a resume under another launcher is not a
  changed stack).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys
from pathlib import Path

import torch

from threefold.checkpoint.manifest import sha256_of
from threefold.observe.host import available_cores, cpu_model
from threefold.preflight.nodes import host_name
from threefold.version import __version__

HARD = frozenset(
    {
        "torch",
        "torch_git",
        "torch_build",
        "cuda_runtime",
        "cuda_driver",
        "cudnn",
        "nccl",
        "nccl_sha256",
        "threefold",
        "threefold_source",
        "device_name",
    }
)
PER_HOST = frozenset(
    {
        "host",
        "pid",
        "device",
        "threefold_path",
        "CUDA_VISIBLE_DEVICES",
        # What a launcher sets for its own workers (torchelastic's agent, distributed/launch.py),
        # the same on every rank it starts: a resume under another launcher is not another stack.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    }
)
# The variables that steer communication and kernels (TORCH_ covers TORCH_NCCL_ too).
ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH_")
ENV_NAMES = frozenset({"OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF"})
PACKAGE = Path(__file__).resolve().parents[1]
"""The threefold package this process runs, where it was imported from."""


def kind_of(key: str) -> str:
    """The key's kind, "hard", "soft" or "host" (the module's docstring); a key no table names is soft."""
    if key in PER_HOST:
        return "host"
    return "hard" if key in HARD else "soft"


def is_environment(key: str) -> bool:
    return key.startswith(ENV_PREFIXES) or key in ENV_NAMES


def fingerprint(device: torch.device) -> dict[str, str]:
    """This rank's stack (keys in the module's docstring): cheap after the first call, whose
    hashes of the package's source and of the NCCL library are kept for the process."""
    fp = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version or "unknown",
        "torch_build": _torch_build(),
        "threefold": __version__,
        "threefold_source": source_digest(PACKAGE),
        "threefold_path": str(PACKAGE),
    }
    fp.update(_packages())
    maps = _read_maps()
    fp.update(_nccl(device, maps))
    if device.type == "cuda":
        fp.update(_cuda(device, maps))
    else:
        fp["device_name"] = device.type
    fp.update(cpu_model=cpu_model(), cpu_cores=str(available_cores()))
    fp.update({k: v for k, v in os.environ.items() if is_environment(k)})
    fp.update(host=host_name(), pid=str(os.getpid()), device=str(device))
    return fp


def apply_stack_drill(fp: dict, overrides: tuple[tuple[str, str], ...]) -> dict:
    """The `stack` drill: the fingerprint with the drill's (key, value) pairs reported instead,
    as a rank with that library or variable would report it (a key it lacked is added)."""
    return {**fp, **dict(overrides)}


def comparable(fp: dict, kind: str) -> dict[str, str]:
    """The keys of `fp` of one kind ("hard" or "soft")."""
    return {k: v for k, v in fp.items() if kind_of(k) == kind}


def digest(fp: dict, kind: str) -> tuple[int, int]:
    """128 bits of the sha256 of the keys of one kind, as two int64 words: equal stacks give
    equal words on every rank (keys sorted, one canonical JSON text)."""
    text = json.dumps(comparable(fp, kind), sort_keys=True, separators=(",", ":"))
    raw = hashlib.sha256(text.encode()).digest()
    return (int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:16], "little", signed=True))


@functools.cache
def source_digest(root: Path) -> str:
    """One sha256 over every .py file of the package under `root` (relative path and content).
    All of them, not only the modules this rank has imported so far: rank 0 imports modules
    (report writers) the others do not, and that is no difference of source."""
    total = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        total.update(str(path.relative_to(root)).encode() + b"\0")
        total.update(hashlib.sha256(path.read_bytes()).digest())
    return total.hexdigest()


@functools.cache
def file_digest(path: str) -> str:
    """sha256 of a file's content, read once per path per process (libnccl is hundreds of MB)."""
    return sha256_of(Path(path))


def mapped_library(maps: str, prefixes: tuple[str, ...]) -> str | None:
    """The path of the first shared object in a /proc/<pid>/maps text whose file name starts
    with one of `prefixes` (e.g. "libnccl"), or None."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            path = fields[5].strip()
            if Path(path).name.startswith(prefixes) and ".so" in Path(path).name:
                return path
    return None


def nccl_version_text(version) -> str:
    """torch.cuda.nccl.version(): a tuple (2, 21, 5) on recent torch, an int 22105 (or 2708
    before NCCL 2.9's code) on old ones."""
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version[:3]) + (f"-{version[3]}" if len(version) > 3 else "")
    code = int(version)
    major, rest = (code // 10000, code % 10000) if code >= 10000 else (code // 1000, code % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def nvml_keys(pynvml, bus_id: str) -> dict[str, str]:
    """Clocks, ECC and power limit of the GPU at PCI `bus_id`, as NVML reads them (soft keys);
    what NVML cannot read is left out."""
    keys: dict[str, str] = {}
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    except pynvml.NVMLError:
        return keys
    reads = {
        "gpu_sm_clock_max": lambda: f"{pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)} MHz",
        "gpu_sm_clock_app": lambda: f"{pynvml.nvmlDeviceGetApplicationsClock(handle, pynvml.NVML_CLOCK_SM)} MHz",
        "gpu_ecc": lambda: "on" if pynvml.nvmlDeviceGetEccMode(handle)[0] else "off",
        "gpu_power_limit": lambda: f"{pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) // 1000} W",
    }
    for key, read in reads.items():
        try:
            keys[key] = read()
        except pynvml.NVMLError:  # not supported on this GPU
            pass
    return keys


def _torch_build() -> str:
    if torch.version.hip:
        return f"hip {torch.version.hip}"
    return f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu"


def _packages() -> dict[str, str]:
    """Versions of the packages that change numerics or speed, without importing one that this
    process has not imported (triton takes seconds): its module's version once imported, else
    the installed distribution's."""
    out, installed = {}, None
    for name in ("numpy", "triton"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__version__", None):
            out[name] = str(module.__version__)
            continue
        if importlib.util.find_spec(name) is None:
            continue
        installed = installed or importlib.metadata.packages_distributions()  # e.g. triton <- pytorch-triton
        for dist in installed.get(name, []):
            out[name] = importlib.metadata.version(dist)
            break
    return out


def _read_maps() -> str:
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return ""


def _nccl(device: torch.device, maps: str) -> dict[str, str]:
    """NCCL (RCCL on ROCm) as this process loaded it: the library mapped, its content, and the
    version it reports (CUDA builds only; a CPU build has none to ask)."""
    out = {}
    path = mapped_library(maps, ("libnccl", "librccl"))
    if path is not None:
        out["nccl_path"] = path
        out["nccl_sha256"] = file_digest(path)
    if device.type == "cuda":
        out["nccl"] = nccl_version_text(torch.cuda.nccl.version())
        out.setdefault("nccl_path", "linked into torch")
    return out


def _cuda(device: torch.device, maps: str) -> dict[str, str]:
    props = torch.cuda.get_device_properties(device)
    out = {
        "device_name": props.name,
        "device_count": str(torch.cuda.device_count()),
        "device_memory": f"{props.total_memory / 2**30:.1f} GiB",
        "cuda_runtime": _cuda_runtime(maps),
    }
    driver = _driver()
    if driver:
        out["cuda_driver"] = driver
    if torch.backends.cudnn.is_available():
        out["cudnn"] = str(torch.backends.cudnn.version())
    bus = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    if None not in bus and importlib.util.find_spec("pynvml") is not None:
        import pynvml

        out.update(nvml_keys(pynvml, f"{bus[0]:08x}:{bus[1]:02x}:{bus[2]:02x}.0"))
    return out


def _cuda_runtime(maps: str) -> str:
    """The CUDA runtime as loaded (cudaRuntimeGetVersion of the libcudart mapped), else the
    version torch was built with (a runtime linked into torch)."""
    path = mapped_library(maps, ("libcudart",))
    if path is not None:
        version = ctypes.c_int()
        if ctypes.CDLL(path).cudaRuntimeGetVersion(ctypes.byref(version)) == 0:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    return torch.version.cuda or torch.version.hip or "unknown"


def _driver() -> str | None:
    """The kernel driver's version: /proc/driver/nvidia/version, else NVML, else None."""
    try:
        found = re.search(r"Kernel Module\s+(\S+)", Path("/proc/driver/nvidia/version").read_text())
        if found:
            return found.group(1)
    except OSError:
        pass
    if importlib.util.find_spec("pynvml") is None:
        return None
    import pynvml

    try:
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError:
        return None
    return version.decode() if isinstance(version, bytes) else str(version)
