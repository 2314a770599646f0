"""benchmarks/gpu_check.py on a machine without a GPU: its CLI, its refusal, and a
CPU smoke run of its kernel and throughput sections (tiny shapes, interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def run_script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_help_lists_the_options():
    result = run_script("--help", timeout=60)
    assert result.returncode == 0
    for option in ("--sections", "--models", "--batch-sizes", "--budget-s", "--allow-cpu", "--json"):
        assert option in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_refuses_to_run_without_a_gpu():
    result = run_script(timeout=120)
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr


@pytest.mark.extended  # make test-extended: a whole smoke run of the GPU script
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run is for machines without a GPU")
def test_cpu_smoke_run_passes_kernel_checks_and_times_decode(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = run_script("--allow-cpu", "--sections", "kernels,throughput", "--no-hf", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "RESULT: PASS" in result.stdout
    report = json.loads(out.read_text())
    names = {c["name"] for c in report["checks"] if c["status"] == "PASS"}
    assert {"rms_norm(+residual)/bfloat16", "rotary/bfloat16", "silu_and_mul/bfloat16",
            "write_kv_cache/bfloat16", "attention/mixed_gqa3_d64",
            "attention/decode_b1_long_ctx_splitk", "attention/sinks/decode_splitk_long_ctx",
            "attention/sinks/sliding_mixed", "attention/mla/decode_d576_h128",
            "attention/mla/mixed_d576_h16"} <= names
    rows = report["throughput"]
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["eager"] > 0 and r["roofline"] > 0 for r in rows)
