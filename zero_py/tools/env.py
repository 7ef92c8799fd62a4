"""`python -m zero_py env`: what zero_py runs with here — versions, the CPU and the instruction
set the CPU kernels chose, and whether the CUDA kernels and the native NCCL executor can run
(and why not). Paste its output into bug reports."""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Dict, List, Optional, Tuple


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def reset_peak_rss() -> bool:
    """Resets the kernel's record of this process's peak RSS (VmHWM) to its current RSS
    (Linux: /proc/self/clear_refs); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_status_kib(field: str) -> int:
    """A kB field of this process's /proc/self/status (VmRSS, VmHWM, ...; Threads counts);
    0 where the system has none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def report() -> List[Tuple[str, str]]:
    """(label, value) rows of the environment report."""
    import os

    import torch

    import zero_py
    from zero_py.collectives import nccl
    from zero_py.kernels import cuda

    rows = [("zero_py", f"{zero_py.__version__} ({os.path.dirname(zero_py.__file__)})"),
            ("python", f"{platform.python_version()} ({platform.python_implementation()})"),
            ("torch", torch.__version__),
            ("safetensors", _version("safetensors")),
            ("transformers", _version("transformers")),
            ("platform", platform.platform()),
            ("CPU", f"{cpu_model()}, {os.cpu_count()} logical cores")]
    try:
        from zero_py._native import _C
        isa: Optional[str] = _C.cpu_isa()
        rows.append(("CPU kernels", f"{isa} (zero_py._C)"))
    except (ImportError, AttributeError) as exc:
        rows.append(("CPU kernels", f"unavailable: {exc}"))
    rows.append(("torch.distributed", "available" if torch.distributed.is_available()
                 else "not available in this torch build"))
    rows.append(("gloo", "available" if torch.distributed.is_gloo_available() else "no"))
    why_cuda = cuda.unavailable_reason()
    rows.append(("CUDA kernels", "usable" if why_cuda is None else f"no: {why_cuda}"))
    if torch.cuda.is_available():
        rows.append(("GPU", f"{torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()}), "
                            f"CUDA {torch.version.cuda}"))
    why_nccl = nccl.unavailable_reason()
    if why_nccl is None:
        code = nccl.load_nccl()
        rows.append(("NCCL executor", f"usable (NCCL {code // 10000}.{code // 100 % 100}."
                                      f"{code % 100})"))
    else:
        rows.append(("NCCL executor", f"no: {why_nccl}"))
    return rows


def as_dict() -> Dict[str, str]:
    return dict(report())


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "env", help="versions, CPU instruction set, CUDA/NCCL availability and why not",
        description="Prints the versions zero_py runs with, the CPU and the instruction set "
                    "its kernels use, and whether the CUDA kernels and the NCCL executor can "
                    "run here (and if not, why).")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_main)


def _main(args) -> int:
    rows = report()
    if args.json:
        import json

        print(json.dumps(dict(rows), indent=2))
        return 0
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    return 0
