"""global.lora: the engine pod runs with --enable-lora and its limits, the gateway serves
the listed adapters by name, and the rendered command lines parse as the real CLIs do."""

from __future__ import annotations

import yaml

from chart_manifests import flags, pods

LORA_VALUES = {"global": {"lora": {
    "enabled": True, "maxLoras": 2, "maxLoraRank": 32, "maxCpuLoras": 4,
    "allowRuntimeUpdating": True,
    "modules": [{"name": "sql", "path": "/var/cache/pagoda/adapters/sql"},
                {"name": "chat", "path": "/var/cache/pagoda/adapters/chat",
                 "baseModelName": "smol"}]}}}


def _values_file(tmp_path, values: dict):
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _container(rendered, deployment: str, service: str) -> dict:
    (pod,) = [p for p in pods(rendered) if p.deployment == deployment]
    return pod.container(service)


def test_lora_values_reach_the_engine_and_the_gateway(chart, tmp_path):
    from pagoda.services.cli.main import build_parser

    rendered = chart.template(values=(_values_file(tmp_path, LORA_VALUES),))
    parser = build_parser()
    for service in ("scheduler", "gpu-worker"):
        container = _container(rendered, "pagoda-scheduler", service)
        engine = flags(container)
        assert (engine["max-loras"], engine["max-lora-rank"], engine["max-cpu-loras"]) == \
            ("2", "32", "4")
        args = parser.parse_args(container["args"])
        assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 2, 32)
    gateway = _container(rendered, "pagoda-gateway", "gateway")
    args = parser.parse_args(gateway["args"])
    assert [(m.name, m.path, m.base_model_name) for m in args.lora_modules] == [
        ("sql", "/var/cache/pagoda/adapters/sql", None),
        ("chat", "/var/cache/pagoda/adapters/chat", "smol")]
    assert args.allow_runtime_lora_updating


def test_lora_is_off_by_default(chart):
    rendered = chart.template()
    engine = flags(_container(rendered, "pagoda-scheduler", "scheduler"))
    assert "enable-lora" not in engine
    assert "--lora-modules" not in _container(rendered, "pagoda-gateway", "gateway")["args"]


def test_adapters_without_lora_enabled_are_refused(chart, tmp_path):
    values = {"global": {"lora": {"modules": [{"name": "sql", "path": "/a/sql"}]}}}
    error = chart.template_error(values=(_values_file(tmp_path, values),))
    assert "global.lora: modules and allowRuntimeUpdating need global.lora.enabled=true" in error
    relative = {"global": {"lora": {"enabled": True,
                                    "modules": [{"name": "sql", "path": "adapters/sql"}]}}}
    assert "path" in chart.template_error(values=(_values_file(tmp_path, relative),))
