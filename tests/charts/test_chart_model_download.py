"""A Hugging Face model id in the chart: one `pagoda download` init container per pod that
loads the model, the token only there and only from a Secret, the containers offline."""

from __future__ import annotations

import pytest

from chart_harness import HelmFailed
from chart_manifests import flags, pods

HUB = ("global.model=Qwen/Qwen3-8B", "global.revision=v1.2",
       "global.hfTokenSecret.name=my-hf", "global.hfTokenSecret.key=tok")
MODEL_USERS = {"pagoda-scheduler": ("scheduler", "gpu-worker"), "pagoda-tokenizer": ("tokenizer",)}


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _all_containers(pod) -> list[dict]:
    return pod.spec.get("initContainers", []) + pod.containers


def test_a_path_model_downloads_nothing_and_gets_no_token(chart):
    rendered = chart.template(sets=("global.hfTokenSecret.name=my-hf",))
    for pod in pods(rendered):
        assert "initContainers" not in pod.spec, pod.deployment
        for c in pod.containers:
            assert not {"HF_TOKEN", "HF_HUB_OFFLINE"} & set(_env(c)), (pod.deployment, c["name"])


def test_each_model_pod_downloads_once_before_its_containers_start(chart):
    rendered = chart.template(sets=HUB)
    by_name = {p.deployment: p for p in pods(rendered)}
    for deployment, services in MODEL_USERS.items():
        pod = by_name[deployment]
        (init,) = pod.spec["initContainers"]  # one download for the pod, whatever it runs
        tokenizer_only = deployment == "pagoda-tokenizer"
        assert init["args"] == ["download", "Qwen/Qwen3-8B", "--revision=v1.2",
                                *(["--tokenizer-only"] if tokenizer_only else [])]
        cache = {m["mountPath"] for m in init["volumeMounts"] if m["name"] == "model-cache"}
        for service in services:
            c = pod.container(service)
            # Same cache, same HF_HOME, same revision; and it never downloads itself.
            assert cache == {m["mountPath"] for m in c["volumeMounts"]
                             if m["name"] == "model-cache"} != set()
            assert _env(c)["HF_HOME"] == _env(init)["HF_HOME"]
            assert _env(c)["HF_HUB_OFFLINE"]["value"] == "1"
            assert (flags(c)["model"], flags(c)["revision"]) == ("Qwen/Qwen3-8B", "v1.2")
        volumes = {v["name"] for v in pod.spec["volumes"]}
        assert {m["name"] for m in init["volumeMounts"]} <= volumes
        assert init["securityContext"]["readOnlyRootFilesystem"]
    others = [p for p in pods(rendered) if p.deployment not in MODEL_USERS]
    assert others and all("initContainers" not in p.spec for p in others)


def test_the_token_comes_from_the_secret_to_the_download_only(chart):
    rendered = chart.template(sets=HUB)
    holders = []
    for pod in pods(rendered):
        for c in _all_containers(pod):
            # Never on a command line (visible in the pod spec and in `ps`).
            assert not any(word in a for a in c.get("args", [])
                           for word in ("my-hf", "HF_TOKEN", "hf-token", "tok=")), c
            token = _env(c).get("HF_TOKEN")
            if token is not None:
                assert token["valueFrom"]["secretKeyRef"] == {"name": "my-hf", "key": "tok"}
                assert "value" not in token
                holders.append((pod.deployment, c["name"]))
    assert sorted(holders) == [("pagoda-scheduler", "download-model"),
                               ("pagoda-tokenizer", "download-model")]


def test_the_rendered_command_lines_parse(chart):
    """The init container's and the model containers' args are real `pagoda` flags."""
    from pagoda.services.cli.main import build_parser

    rendered = chart.template(sets=HUB)
    parser = build_parser()
    for deployment, services in MODEL_USERS.items():
        (pod,) = [p for p in pods(rendered) if p.deployment == deployment]
        (init,) = pod.spec["initContainers"]
        args = parser.parse_args(init["args"])
        assert (args.model, args.revision) == ("Qwen/Qwen3-8B", "v1.2")
        for service in services:
            args = parser.parse_args(pod.container(service)["args"])
            assert (args.model, args.revision) == ("Qwen/Qwen3-8B", "v1.2")


@pytest.mark.parametrize("model", ["models/llama/model.gguf", "./model.gguf", "Qwen3-8B"])
def test_a_model_that_is_neither_absolute_path_nor_hub_id_is_refused(chart, model):
    with pytest.raises(HelmFailed, match="global.model"):
        chart.template(sets=(f"global.model={model}",))
