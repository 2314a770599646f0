"""gateway.apiServerCount: vLLM's --api-server-count on the gateway container (absent at
the default 1, so the default pod is unchanged), and the rendered command line parses
as the real CLI does."""

from __future__ import annotations

import yaml

from chart_manifests import pods


def _gateway(rendered) -> dict:
    (pod,) = [p for p in pods(rendered) if p.deployment == "pagoda-gateway"]
    return pod.container("gateway")


def test_api_server_count_reaches_the_gateway(chart, tmp_path):
    from pagoda.services.cli.main import build_parser

    values = tmp_path / "asc.yaml"
    values.write_text(yaml.safe_dump({"gateway": {"apiServerCount": 4}}))
    container = _gateway(chart.template(values=(values,)))
    assert "--api-server-count=4" in container["args"]
    assert build_parser().parse_args(container["args"]).api_server_count == 4


def test_one_gateway_process_by_default(chart):
    args = _gateway(chart.template())["args"]
    assert not any(a.startswith("--api-server-count") for a in args)
