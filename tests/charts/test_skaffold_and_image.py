"""skaffold.yaml builds docker/Dockerfile and deploys charts/pagoda consistently in both
profiles; the Dockerfile provides what the chart relies on (entry point, user, model path)."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from chart_harness import CHART, ROOT, merged_values
from chart_manifests import pods

SKAFFOLD = yaml.safe_load((ROOT / "skaffold.yaml").read_text())
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()


def _apply_profile(config: dict, name: str) -> dict:
    """Apply a profile's JSON patches (only `replace` is used) the way skaffold does."""
    (profile,) = [p for p in config["profiles"] if p["name"] == name]
    out = copy.deepcopy(config)
    for patch in profile["patches"]:
        assert patch["op"] == "replace"
        *parents, leaf = patch["path"].strip("/").split("/")
        node = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key = int(leaf) if isinstance(node, list) else leaf
        assert key in node if isinstance(node, dict) else key < len(node), patch["path"]
        node[key] = patch["value"]
    return out


@pytest.mark.parametrize(("profile", "variant", "device"), [("cpu", "cpu", "cpu"),
                                                             ("gpu", "cuda", "cuda")])
def test_profile_builds_the_variant_its_values_expect(chart, profile, variant, device):
    config = _apply_profile(SKAFFOLD, profile)
    assert config["apiVersion"] == "skaffold/v4beta13"
    (artifact,) = config["build"]["artifacts"]
    assert (ROOT / artifact["context"] / artifact["docker"]["dockerfile"]).is_file()
    assert artifact["docker"]["buildArgs"]["VARIANT"] == variant
    (release,) = config["deploy"]["helm"]["releases"]
    assert (ROOT / release["chartPath"]).resolve() == CHART
    files = [ROOT / f for f in release["valuesFiles"]]
    assert merged_values(*files)["global"]["device"] == device

    # skaffold fills these templates with the image it built; the chart must use it everywhere.
    image = artifact["image"].replace("-", "_")
    templates = release["setValueTemplates"]
    assert f".IMAGE_REPO_{image}" in templates["global.image.repository"]
    assert f".IMAGE_TAG_{image}" in templates["global.image.tag"]
    built = ("registry.example/pagoda", "abc123@sha256:" + "0" * 64)
    rendered = chart.template(values=tuple(files), sets=(
        f"global.image.repository={built[0]}", f"global.image.tag={built[1]}"))
    images = {c["image"] for p in pods(rendered) if p.deployment != "pagoda-redis"
              for c in p.containers}
    assert images == {f"{built[0]}:{built[1]}"}

    forward = config["portForward"][0]
    gateway = rendered.named("Service", forward["resourceName"])
    assert forward["port"] in {p["port"] for p in gateway["spec"]["ports"]}
    assert release["name"] == "pagoda"  # the release name the Service names above assume


def test_dockerfile_provides_what_the_chart_relies_on():
    # Containers set only args starting with the service name.
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "pagoda"]' in DOCKERFILE
    assert re.search(r"^ARG VARIANT=cpu$", DOCKERFILE, re.MULTILINE)
    assert "cpu)" in DOCKERFILE and "cuda)" in DOCKERFILE
    # The pods run as uid 10001 with runAsNonRoot, which needs a numeric USER.
    assert re.search(r"^USER 10001:10001$", DOCKERFILE, re.MULTILINE)
    assert "--uid 10001" in DOCKERFILE
    # The chart's default model is the GGUF the image links into place.
    default_model = merged_values()["global"]["model"]
    assert re.search(rf"ln -s \S+ {re.escape(default_model)};", DOCKERFILE)
    cache = merged_values()["global"]["modelCache"]["mountPath"]
    assert f'VOLUME ["{cache}"]' in DOCKERFILE
    assert f"HF_HOME={cache}/huggingface" in DOCKERFILE


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".cache"} <= ignored
