"""Disaggregated clusters for the tests in tests/disaggregation: `pagoda serve --prefill-replicas 1
--decode-replicas 1` and a colocated one to compare against, one Redis for both."""

from __future__ import annotations

import psutil
from serve_cluster import CLI_MODULE, ServeProcess, flag_value

BASE = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "1024",
        "--block-size", "16"]


def start_pd(model_dir: str, redis_url: str, *extra: str) -> ServeProcess:
    return ServeProcess([model_dir, *BASE, "--redis-url", redis_url, "--prefill-replicas", "1",
                         "--decode-replicas", "1", *extra])


def role_process(serve: ServeProcess, kind: str, role: str) -> psutil.Process:
    """The `kind` process (scheduler, gpu-worker) whose --kv-transfer-config has `role`."""
    for child in psutil.Process(serve.process.pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if CLI_MODULE in cmd and cmd[cmd.index(CLI_MODULE) + 1] == kind \
                and "--kv-transfer-config" in cmd \
                and f'"kv_role":"{role}"' in flag_value(cmd, "--kv-transfer-config"):
            return child
    raise LookupError(f"{kind} {role}")


def role_address(serve: ServeProcess, kind: str, role: str) -> str:
    return f"127.0.0.1:{flag_value(role_process(serve, kind, role).cmdline(), '--port')}"
