"""What this CPU can do, read once from /proc/cpuinfo (no torch: the CLI and the layers
both ask)."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4)
def cpu_has_fast_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """True when the CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    try:
        with open(cpuinfo_path, encoding="utf-8") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split()}
    except OSError:  # not Linux: no cheap way to tell; fp32 is the safe choice
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})
