"""A driver that finds no Ray cluster starts a private head as a child process and
joins it by address: `ray.init()` would fork the driver (with a `preexec_fn`), which
is unsafe once it has gRPC or other threads. The head, and every process Ray
started for it, stops with the group.

`test_ray_in_own_process.py` runs this module in a child pytest (a raylet that dies
ends its driver, which must not be the whole test run).
"""

from __future__ import annotations

import os

import psutil
import pytest
from group_cases import GREEDY_PROMPTS, engine_kwargs, greedy_params
from serve_cluster import wait_until

from pagoda import LLM

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended

_forks: list[int] = []  # pids that forked while `_counting` held a True
_counting = [False]
os.register_at_fork(before=lambda: _counting[0] and _forks.append(os.getpid()))


def is_gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_driver_without_ray_starts_a_private_head_and_stops_it(tiny_llama_dir, reference,
                                                                monkeypatch):
    import ray

    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    _counting[0] = True
    try:
        llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2,
                  distributed_executor_backend="ray", **engine_kwargs())
        try:
            outputs = llm.generate(GREEDY_PROMPTS[:2], greedy_params(), use_tqdm=False)
            head = llm.llm_engine.core.executor._head.process
            ray_processes = psutil.Process(head.pid).children(recursive=True)
            assert any("raylet" in " ".join(p.cmdline()) for p in ray_processes)
        finally:
            llm.llm_engine.core.shutdown()
    finally:
        _counting[0] = False
    assert [o.outputs[0].token_ids for o in outputs] == reference.token_ids[:2]
    assert _forks == []  # joining the head forked nothing here
    assert not ray.is_initialized() and head.poll() is not None
    assert wait_until(lambda: all(is_gone(p) for p in ray_processes), 15)


def test_the_private_head_refuses_a_process_without_its_token():
    """Token authentication: the driver (with `auth_env`) joins; a process on the same
    machine without the token cannot."""
    import subprocess
    import sys

    from pagoda.executor.ray_head import PrivateRayHead

    join = "import ray, sys; ray.init(address=sys.argv[1]); print('joined'); ray.shutdown()"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    head = PrivateRayHead(num_cpus=1).start()
    try:
        token_path = head.auth_env["RAY_AUTH_TOKEN_PATH"]
        assert oct(os.stat(token_path).st_mode & 0o777) == "0o600"
        with_token = subprocess.run([sys.executable, "-c", join, head.address],
                                    env={**clean, **head.auth_env}, capture_output=True,
                                    text=True, timeout=240)
        assert with_token.returncode == 0 and "joined" in with_token.stdout, with_token.stderr
        without = subprocess.run([sys.executable, "-c", join, head.address], env=clean,
                                 capture_output=True, text=True, timeout=240)
        assert without.returncode != 0 and "joined" not in without.stdout
        assert "AuthenticationError" in without.stderr
    finally:
        head.stop()
