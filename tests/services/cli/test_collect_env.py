"""`pagoda collect-env`: what a bug report needs, read from this very machine."""

from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

import pagoda
from pagoda.services.cli.collect_env import CPU_FLAGS, cpu_model_and_flags
from pagoda.services.cli.main import main


def test_report_has_versions_gpu_cpu_and_dependencies(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "do-not-print-me")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert main(["collect-env"]) == 0
    report = capsys.readouterr().out
    assert f"Python version: {platform.python_version()}" in report
    assert f"Pagoda version: {pagoda.__version__}" in report
    assert f"Installed at: {os.path.dirname(pagoda.__file__)}" in report
    assert f"PyTorch version: {torch.__version__}" in report
    assert f"CUDA available: {torch.cuda.is_available()}" in report
    assert f"transformers=={importlib.metadata.version('transformers')}" in report
    assert f"Triton version: {importlib.metadata.version('triton')}" in report
    if torch.cuda.is_available():
        assert f"GPU 0: {torch.cuda.get_device_name(0)}" in report
    # The CPU flags line lists exactly the interesting flags /proc/cpuinfo has.
    _, flags = cpu_model_and_flags()
    present = [f for f in CPU_FLAGS if f in flags]
    flags_line = next(line for line in report.splitlines() if line.startswith("ISA flags:"))
    if present:
        assert flags_line.split(": ", 1)[1].split() == present
    # Set variables are shown, secrets hidden.
    assert "VLLM_LOGGING_LEVEL=DEBUG" in report
    assert "VLLM_API_KEY=<hidden>" in report and "do-not-print-me" not in report


def test_cpuinfo_parsing(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU @ 2.0GHz\n"
                       "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile\n\n"
                       "processor\t: 1\nmodel name\t: Some CPU @ 2.0GHz\nflags\t\t: fpu\n")
    model, flags = cpu_model_and_flags(str(cpuinfo))
    assert model == "Some CPU @ 2.0GHz"
    assert {"avx2", "avx512f", "avx512_bf16", "amx_tile"} <= flags
    assert cpu_model_and_flags(str(tmp_path / "absent")) == (None, set())
