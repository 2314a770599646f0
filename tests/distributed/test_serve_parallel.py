"""`pagoda serve MODEL --tensor-parallel-size 2`: the gpu-worker drives a Ray-placed
group as its rank 0. Same tokens as one device through the OpenAI API; then a rank
dies mid-stream: the group is rebuilt, the stream finishes with the tokens of an
undisturbed run, /health stays 200 and the rebuild is counted."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import psutil
import pytest
from group_cases import GREEDY_PROMPTS, engine_kwargs

from serve_cluster import ServeProcess, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended


def serve_flags(model: str) -> list[str]:
    kwargs = engine_kwargs()
    return [model, "--served-model-name", "tiny", "--dtype", kwargs["dtype"],
            "--max-model-len", str(kwargs["max_model_len"]),
            "--block-size", str(kwargs["block_size"]),
            "--max-num-batched-tokens", str(kwargs["max_num_batched_tokens"]),
            "--num-gpu-blocks-override", str(kwargs["num_gpu_blocks_override"]),
            "--tensor-parallel-size", "2"]


def rank_actor_pids(serve: ServeProcess) -> list[int]:
    """Ray worker processes running a follower rank (Ray titles them after the actor)."""
    pids = []
    for child in psutil.Process(serve.process.pid).children(recursive=True):
        try:
            if "_RankActor" in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:
            continue
    return pids


def own_raylets(serve: ServeProcess) -> list[psutil.Process]:
    """The raylets of this cluster's private Ray head (other tests may run Ray heads of
    their own at the same time: `make test` runs two modules at once)."""
    raylets = []
    for child in psutil.Process(serve.process.pid).children(recursive=True):
        try:
            if "raylet" in " ".join(child.cmdline()):
                raylets.append(child)
        except psutil.Error:
            continue
    return raylets


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_serve_tensor_parallel_matches_one_device_and_survives_a_dead_rank(tiny_llama_dir, reference):
    serve = ServeProcess(serve_flags(tiny_llama_dir))
    try:
        raylets = own_raylets(serve)
        assert raylets, "no raylet under pagoda serve"
        assert "--tensor-parallel-size" in serve.service_args("scheduler")
        tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(tiny_llama_dir)
        client = openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=120)
        for prompt, want in zip(GREEDY_PROMPTS, reference.token_ids):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)

        pids = rank_actor_pids(serve)
        assert len(pids) == 1  # rank 1; rank 0 is the gpu-worker itself
        story = dict(model="tiny", prompt="Tell me a long story", max_tokens=160,
                     temperature=0, extra_body={"ignore_eos": True})
        want = client.completions.create(**story).choices[0].text
        stream = client.completions.create(stream=True, **story)
        text = next(iter(stream)).choices[0].text  # the request is running
        os.kill(pids[0], signal.SIGKILL)
        text += "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == want
        assert "rank 1: actor died" in serve.stderr_text()
        health = serve.url.removesuffix("/v1") + "/health"
        assert httpx.get(health).status_code == 200
        assert sum(v for (name, _), v in serve.scrape().items()
                   if name == "pagoda_worker_group_rebuilds_total") == 1
        new_pids = rank_actor_pids(serve)
        assert len(new_pids) == 1 and new_pids != pids
    finally:
        code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]
    # The gpu-worker shut its Ray instance down on the way out.
    assert wait_until(lambda: not any(alive(p) for p in raylets), 15)
