"""Processes for benchmarks/peers.py: commands that print JSON, servers, llama.cpp's tables.

Every process is started here with a time limit, in its own session, and stopped
(it and every descendant, by id) before the function that started it returns.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shlex
import signal
import subprocess
import time
from typing import Iterator

import httpx

LOG_TAIL = 2000  # characters of a failed command's output kept in its error


class CommandFailed(RuntimeError):
    pass


def run_command(argv: list[str], timeout: float) -> str:
    """stdout of `argv`; a CommandFailed with the output's tail if it fails or times out."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                             start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-LOG_TAIL:]
        raise CommandFailed(f"timed out after {timeout:.0f} s: {shlex.join(argv)}\n{tail!r}") from None
    if out.returncode != 0:
        raise CommandFailed(f"exit {out.returncode}: {shlex.join(argv)}\n"
                            f"{(out.stderr or out.stdout)[-LOG_TAIL:]}")
    return out.stdout


def last_json_line(stdout: str) -> dict:
    """The last line of `stdout` that parses as a JSON object."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    raise CommandFailed(f"no JSON line in the output:\n{stdout[-LOG_TAIL:]}")


def batched_bench_row(stdout: str, batch: int) -> dict[str, float]:
    """The row of `llama-batched-bench`'s markdown table whose B column is `batch`,
    keyed by its header (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s)."""
    header: list[str] | None = None
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and not set(cells[0]) <= set("-: "):
            row = dict(zip(header, cells))
            if row.get("B") == str(batch):
                return {k: float(v) for k, v in row.items()}
    raise CommandFailed(f"no B={batch} row in llama-batched-bench's output:\n{stdout[-LOG_TAIL:]}")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and every live descendant (a server and the
    services it started), from /proc: a noise check on what a load run used."""
    total = 0.0
    for each in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{each}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def wait_until_serving(url: str, process: subprocess.Popen, timeout: float) -> str:
    """Poll until the server completes a one-token request (then its first model id);
    fail early if it exits first. `/v1/models` alone is not enough: Pagoda's gateway
    lists the model before its tokenizer is up, and answers 503 until it is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise CommandFailed(f"the server exited with {process.returncode} while starting")
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
            reply = httpx.post(f"{url}/v1/completions", timeout=60,
                               json={"model": model, "prompt": "Hello", "max_tokens": 1})
            if reply.status_code == 200:
                return model
        time.sleep(1.0)
    raise CommandFailed(f"{url} did not serve within {timeout:.0f} s")


@contextlib.contextmanager
def server(argv: list[str], url: str, log_path: str, timeout: float) -> Iterator[tuple[str, int]]:
    """Start a server, yield (its model id, its pid) once it serves, stop it on exit."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            yield wait_until_serving(url, process, timeout), process.pid
        except CommandFailed as exc:
            raise CommandFailed(f"{exc}; see {log_path}") from None
        finally:
            stop(process)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (by parent id, from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(stat) as f:
                head, tail = f.read().rsplit(")", 1)
            children.setdefault(int(tail.split()[1]), []).append(int(head.split()[0]))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the server (it stops what it started), then SIGKILL, by pid, whatever of it
    and its descendants is left: `pagoda serve` starts each service in its own session,
    so a process group does not reach them."""
    below = descendants(process.pid)
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    for pid in [process.pid, *below]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
