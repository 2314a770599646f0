"""One local cluster (tiny model, tracing on) for all cluster tests in a module, a
real Prometheus scraping its gateway, and an OTLP collector receiving its spans."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from obs_harness import Prometheus, collector  # noqa: F401 (a fixture)
from serve_cluster import ServeProcess

ROOT = Path(__file__).resolve().parents[2]


def _install_tool():
    spec = importlib.util.spec_from_file_location("install_prometheus",
                                                  ROOT / "tools" / "install_prometheus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    """The Prometheus server binary, installed on first use like `make install` does.

    Missing is a failure, never a skip: the dashboard checks must run in `make test`."""
    tool = _install_tool()
    path = tool.find_prometheus()
    if path is None:
        tool.main([])
        path = tool.find_prometheus()
    if path is None:
        pytest.fail("no prometheus binary and tools/install_prometheus.py could not install "
                    "one; set PROMETHEUS=/path/to/prometheus")
    return str(path)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, collector):
    """All five services (and a private Redis) exporting traces to `collector` quickly."""
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                   "--max-model-len", "1024", "--otlp-traces-endpoint", collector.endpoint,
                   "--log-stats-interval", "1",
                   "--enable-prompt-tokens-details",  # usage's cached tokens vs the metrics
                   "--enable-lora"],  # the LoRA panel's vllm:lora_requests_info
                  env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    yield serve
    code = serve.stop()
    assert code == 0, "".join(serve.log[-60:])


@pytest.fixture(scope="module")
def prometheus(prometheus_binary, cluster, tmp_path_factory):
    server = Prometheus(prometheus_binary, cluster.base.removeprefix("http://"),
                        tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()
