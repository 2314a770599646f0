"""`pagoda bench latency` on the tiny model: vLLM's printout and its --output-json keys."""

from __future__ import annotations

import json

import pytest

from pagoda.services.cli.main import main


def test_latency_prints_and_writes_vllm_keys(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", tiny_llama_dir, "--dtype", "float32",
                 "--batch-size", "2", "--input-len", "8", "--output-len", "4",
                 "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out)]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if "latency" in line]
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and all(t > 0 for t in result["latencies"])
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    values = list(result["percentiles"].values())
    assert values == sorted(values)
    assert min(result["latencies"]) <= values[0] and values[-1] <= max(result["latencies"])
    assert (result["batch_size"], result["input_len"], result["output_len"]) == (2, 8, 4)
    assert result["output_tokens_per_s"] == round(2 * 4 / result["avg_latency"], 2)
    assert printed[0] == f"Avg latency: {result['avg_latency']:.6f} seconds"
    assert printed[1:] == [f"{q}% percentile latency: {v:.6f} seconds"
                           for q, v in result["percentiles"].items()]
