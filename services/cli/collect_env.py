"""`pagoda collect-env`: the environment a bug report needs, as `vllm collect-env` prints it.

Python, the OS, Pagoda itself (version and where it is installed), torch (its CUDA
build, whether a GPU is usable), triton, every GPU with its compute capability and
memory, the NVIDIA driver, the CPU with the instruction-set flags the kernels care
about (from /proc/cpuinfo), the versions of Pagoda's key dependencies, and the
PAGODA_*/VLLM_*/CUDA variables set (values of anything that looks secret hidden).
Each probe that fails prints why instead of stopping the report.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable

import pagoda

# Instruction-set extensions that decide which CPU paths are fast (bf16 matmuls,
# AMX tiles, AVX-512 kernels); listed when /proc/cpuinfo has them.
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "avx_vnni")
DEPENDENCIES = ("torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "gguf",
                "jinja2", "grpcio", "protobuf", "fastapi", "uvicorn", "httpx", "redis", "ray",
                "prometheus-client", "opentelemetry-sdk", "openai", "pyyaml")
ENV_PREFIXES = ("PAGODA_", "VLLM_", "CUDA_", "NCCL_", "OMP_", "TORCH_", "TRITON_", "HF_")
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "collect-env", help="Print the environment for a bug report (versions, GPU, CPU).",
        description=__doc__.split("\n\n")[0])
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    print(collect_env())
    return 0


def collect_env() -> str:
    sections = [("System", _system), ("Pagoda", _pagoda), ("PyTorch and GPUs", _torch),
                ("CPU", _cpu), ("Versions of key dependencies", _dependencies),
                ("Environment variables", _environment)]
    lines: list[str] = []
    for title, probe in sections:
        lines += [f"== {title} =="]
        lines += _safe(probe)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _safe(probe: Callable[[], list[str]]) -> list[str]:
    try:
        return probe()
    except Exception as exc:  # noqa: BLE001 (a report with a hole beats no report)
        return [f"could not collect: {type(exc).__name__}: {exc}"]


def _system() -> list[str]:
    return [f"Python version: {sys.version.split()[0]} ({platform.python_implementation()}, "
            f"{sys.executable})",
            f"OS: {platform.platform()}",
            f"Machine: {platform.machine()}"]


def _pagoda() -> list[str]:
    return [f"Pagoda version: {pagoda.__version__}",
            f"Installed at: {os.path.dirname(pagoda.__file__)}"]


def _torch() -> list[str]:
    # lazy: torch loads only when collect-env runs; the CLI imports this module for its flags
    import torch

    lines = [f"PyTorch version: {torch.__version__}",
             f"PyTorch built with CUDA: {torch.version.cuda or 'no'}",
             f"Triton version: {_version('triton') or 'not installed'}",
             f"CUDA available: {torch.cuda.is_available()}"]
    if torch.cuda.is_available():
        lines.append(f"cuDNN version: {torch.backends.cudnn.version()}")
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            lines.append(f"GPU {index}: {props.name}, compute capability "
                         f"{props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB")
    lines.append(f"NVIDIA driver: {_nvidia_driver() or 'none found (no nvidia-smi)'}")
    return lines


def _nvidia_driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def _cpu() -> list[str]:
    model, flags = cpu_model_and_flags()
    present = [f for f in CPU_FLAGS if f in flags]
    return [f"CPU: {model or platform.processor() or 'unknown'}",
            f"Logical cores: {os.cpu_count()}",
            f"ISA flags: {' '.join(present) if present else 'none of ' + ', '.join(CPU_FLAGS)}"]


def cpu_model_and_flags(path: str = "/proc/cpuinfo") -> tuple[str | None, set[str]]:
    """The first processor's model name and flags (empty where there is no cpuinfo)."""
    model, flags = None, set()
    if not os.path.exists(path):
        return model, flags
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(value.split())
            if model is not None and flags:
                break
    return model, flags


def _dependencies() -> list[str]:
    return [f"{name}=={_version(name) or 'not installed'}" for name in DEPENDENCIES]


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _environment() -> list[str]:
    names = sorted(n for n in os.environ if n.startswith(ENV_PREFIXES))
    if not names:
        return ["(none set)"]
    return [f"{n}={'<hidden>' if any(w in n for w in SECRET_WORDS) else os.environ[n]}"
            for n in names]
