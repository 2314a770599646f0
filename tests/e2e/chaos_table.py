"""The chaos table's harness: streamed load through the official openai client against
`pagoda serve`, one component struck a third of the way in, and the row it prints.

A *strike* is SIGKILL (the supervisor restarts the process) or a freeze (SIGSTOP, then
SIGCONT `FREEZE_S` later: sockets stay open, nothing answers). `run_row` sends
`CHAOS_TABLE_REQUESTS` streamed completions at `CONCURRENCY`, strikes once a third
have ended, and returns every outcome; `check_row` asserts the issue's bar: none lost,
none hung (each stream has `HANG_BOUND_S`, far above any healthy stream's time), none
with an error or a finish other than "length", the cluster's KV usage (vllm:*
gauges on /metrics) back to 0, and /health 200 once the struck component is back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc
import httpx
import openai
import psutil
from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as kpb
from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as kpb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from serve_cluster import CLI_MODULE, ServeProcess, flag_value, scheduler_load, wait_until

CHAOS_TABLE_REQUESTS = int(os.environ.get("PAGODA_CHAOS_TABLE_REQUESTS", "600"))
CONCURRENCY = 64
MAX_TOKENS = 16
FREEZE_S = 10.0
HANG_BOUND_S = 150.0  # a stream longer than this is hung (healthy ones take seconds)
BLOCK_SIZE = 16  # the engine's default
# Several blocks long each: full blocks are what the prefix index records.
PROMPTS = [f"Story {i}: once upon a time in a land of {word}, there lived a quiet keeper of "
           "lighthouses who counted every ship that passed the rocks at night, and wrote"
           for i, word in enumerate(["rivers", "glass", "copper", "wind", "salt", "ash",
                                     "moss", "stone"])]


# The row that strikes one of two gateway processes (`--api-server-count 2`).
GATEWAY_PROCESS = "gateway (one process of two)"


@dataclass
class Row:
    component: str
    fault: str
    completed: int = 0
    errors: int = 0
    hung: int = 0
    lost: int = 0
    restarts: int = 0
    examples: list = field(default_factory=list)

    def line(self) -> str:
        return (f"| {self.component:<26} | {self.fault:<7} | {self.completed:>9} | "
                f"{self.errors:>6} | {self.hung:>4} | {self.lost:>4} | {self.restarts:>8} |")


HEADER = ("| component                  | fault   | completed | errors | hung | lost | restarts |\n"
          "|----------------------------|---------|-----------|--------|------|------|----------|")


def children(serve: ServeProcess) -> dict[int, list[str]]:
    out = {}
    for child in psutil.Process(serve.process.pid).children(recursive=True):
        try:
            out[child.pid] = child.cmdline()
        except psutil.Error:
            continue
    return out


def kind_of(argv: list[str]) -> str:
    if CLI_MODULE in argv:
        return argv[argv.index(CLI_MODULE) + 1]
    return "redis" if argv and ("valkey" in argv[0] or "redis" in argv[0]) else ""


def pids_of(serve: ServeProcess, kind: str) -> list[tuple[int, list[str]]]:
    return [(pid, argv) for pid, argv in children(serve).items() if kind_of(argv) == kind]


def scheduler_ports(serve: ServeProcess) -> list[int]:
    addrs = flag_value(serve.service_args("gateway"), "--scheduler-addrs").split(",")
    return [int(a.rsplit(":", 1)[1]) for a in addrs]


def running(port: int) -> int:
    try:
        return scheduler_load(f"127.0.0.1:{port}", timeout=2).num_running
    except Exception:  # noqa: BLE001 -- down or frozen: not running anything we can see
        return 0


def victim_pid(serve: ServeProcess, component: str) -> int:
    """The process to strike. A model replica's: the busiest replica's (striking an idle
    one tests nothing); "prefill gpu-worker": the kv_producer replica's worker."""
    if component == GATEWAY_PROCESS:  # one of the gateway's API servers (both serve)
        return serve.api_server_pids()[0]
    if component in ("tokenizer", "kv-cache-manager", "redis"):
        found = sorted(pids_of(serve, component), key=lambda p: p[0])
        return found[-1][0]
    schedulers = {int(flag_value(argv, "--port")): argv
                  for _, argv in pids_of(serve, "scheduler")}
    if component == "prefill gpu-worker":
        port = next(p for p, argv in schedulers.items() if "kv_producer" in " ".join(argv))
    else:
        wait_until(lambda: any(running(p) for p in schedulers), 30, interval=0.02)
        port = max(schedulers, key=running)
    if component == "scheduler":
        return next(pid for pid, argv in pids_of(serve, "scheduler")
                    if int(flag_value(argv, "--port")) == port)
    worker_port = flag_value(schedulers[port], "--worker-addr").rsplit(":", 1)[1]
    return next(pid for pid, argv in pids_of(serve, "gpu-worker")
                if flag_value(argv, "--port") == worker_port)


def strike(pid: int, fault: str) -> None:
    if fault == "SIGKILL":
        os.kill(pid, signal.SIGKILL)
        return
    os.kill(pid, signal.SIGSTOP)

    def resume() -> None:
        time.sleep(FREEZE_S)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    threading.Thread(target=resume, daemon=True).start()


def restarts(serve: ServeProcess) -> int:
    return int(sum(v for (name, _), v in serve.scrape().items()
                   if name == "pagoda_service_restarts_total"))


async def _load(url: str, struck: callable) -> list[dict]:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0,
                                timeout=HANG_BOUND_S,
                                http_client=httpx.AsyncClient(
                                    limits=httpx.Limits(max_connections=CONCURRENCY + 8,
                                                        max_keepalive_connections=0),
                                    timeout=HANG_BOUND_S))
    semaphore = asyncio.Semaphore(CONCURRENCY)
    done = 0

    async def stream(i: int) -> dict:
        text, finish = [], None
        response = await client.completions.create(
            model="tiny", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in response:
            for choice in chunk.choices:
                text.append(choice.text)
                finish = choice.finish_reason or finish
        return {"text": "".join(text), "finish_reason": finish}

    async def one(i: int) -> dict:
        nonlocal done
        async with semaphore:
            try:
                result = await asyncio.wait_for(stream(i), HANG_BOUND_S + 10)
            except asyncio.TimeoutError:
                result = {"hung": True}
            except (openai.APIError, httpx.HTTPError) as exc:
                result = {"error": repr(exc)[:300]}
        done += 1
        if done == CHAOS_TABLE_REQUESTS // 3:
            struck()
        return result

    try:
        return await asyncio.gather(*(one(i) for i in range(CHAOS_TABLE_REQUESTS)))
    finally:
        await client.close()


def run_row(serve: ServeProcess, component: str, fault: str) -> Row:
    """The load with `component` struck by `fault` a third of the way in."""
    before = restarts(serve)
    struck_at: list[float] = []

    def struck() -> None:  # in the event loop: find the victim in a thread
        def go() -> None:
            strike(victim_pid(serve, component), fault)
            struck_at.append(time.monotonic())
        threading.Thread(target=go, daemon=True).start()

    began = time.monotonic()
    results = asyncio.run(_load(serve.url, struck))
    print(f"  ({component} {fault}: load took {time.monotonic() - began:.0f} s)", flush=True)
    row = Row(component, fault)
    row.lost = CHAOS_TABLE_REQUESTS - len(results)
    row.hung = sum(1 for r in results if r.get("hung"))
    bad = [r for r in results if not r.get("hung")
           and (r.get("error") or r.get("finish_reason") != "length")]
    row.errors = len(bad)
    row.examples = bad if component == GATEWAY_PROCESS else bad[:3]
    row.completed = sum(1 for r in results if r.get("finish_reason") == "length")
    assert struck_at, "the component was never struck"
    if fault == "SIGKILL":  # back: restarted by `pagoda serve`
        wait_until(lambda: restarts(serve) > before, 60, interval=0.5)
    row.restarts = restarts(serve) - before
    return row


def kv_usage(serve: ServeProcess) -> float:
    return sum(v for (name, _), v in serve.scrape().items()
               if name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                           "vllm:num_requests_waiting"))


def health(serve: ServeProcess) -> int:
    try:
        return httpx.get(f"{serve.base}/health", timeout=10).status_code
    except httpx.HTTPError:
        return 0


def every_scheduler_idle(serve: ServeProcess) -> bool:
    for port in scheduler_ports(serve):
        try:
            load = scheduler_load(f"127.0.0.1:{port}", timeout=5)
        except Exception:  # noqa: BLE001 -- restarting: not idle yet
            return False
        if load.kv_cache_usage or load.num_running or load.num_waiting:
            return False
    return True


def check_row(serve: ServeProcess, row: Row) -> None:
    """The issue's bar for one row (the row is printed first, passing or not; a failed
    row's cluster log goes to $PAGODA_CHAOS_LOG_DIR, when set). A killed gateway process
    may fail the streams open on it (at most CONCURRENCY), each with a clean connection
    error and none hung; every other row fails nothing."""
    print(row.line(), flush=True)
    if (row.lost or row.hung or row.errors) and os.environ.get("PAGODA_CHAOS_LOG_DIR"):
        name = f"{row.component}-{row.fault}.log".replace(" ", "-")
        with open(os.path.join(os.environ["PAGODA_CHAOS_LOG_DIR"], name), "w") as out:
            out.writelines(serve.log)
    assert row.lost == 0 and row.hung == 0, row
    if row.component == GATEWAY_PROCESS and row.fault == "SIGKILL":
        assert row.errors <= CONCURRENCY, f"{row.errors} errors, e.g. {row.examples}"
        assert all("APIConnectionError" in (r.get("error") or "") for r in row.examples), \
            row.examples
        assert row.completed + row.errors == CHAOS_TABLE_REQUESTS
    else:
        assert row.errors == 0, f"{row.errors} errors, e.g. {row.examples}"
        assert row.completed == CHAOS_TABLE_REQUESTS
    if row.fault == "SIGKILL":
        assert row.restarts >= 1, "the killed component was not restarted"
    start = time.monotonic()
    assert wait_until(lambda: health(serve) == 200, 90, interval=0.5) == True  # noqa: E712
    assert wait_until(lambda: every_scheduler_idle(serve), 60, interval=0.5)
    assert wait_until(lambda: kv_usage(serve) == 0, 30, interval=0.5), \
        f"KV usage on /metrics stayed {kv_usage(serve)}"
    print(f"  (health 200, idle and KV usage 0 after {time.monotonic() - start:.0f} s)",
          flush=True)


def indexed_blocks(serve: ServeProcess) -> int:
    """The most leading blocks of PROMPTS[0] the cluster prefix index says any instance
    holds (0 when it cannot answer): after Redis or the kv-cache-manager restarted empty,
    only the schedulers' snapshots can put blocks served before the restart back."""
    gateway = serve.service_args("gateway")
    tokenizer = flag_value(gateway, "--tokenizer-addr").split(",")[0]
    manager = flag_value(gateway, "--kv-cache-manager-addr")
    model = flag_value(serve.service_args("scheduler"), "--model")  # as the schedulers say it
    try:
        with grpc.insecure_channel(tokenizer) as channel:
            hashes = tpb_grpc.TokenizerServiceStub(channel).Tokenize(
                tpb.TokenizeRequest(prompt=PROMPTS[0], add_special_tokens=True,
                                    block_size=BLOCK_SIZE), timeout=10).block_hashes
        with grpc.insecure_channel(manager) as channel:
            reply = kpb_grpc.KvCacheManagerServiceStub(channel).LookupPrefix(
                kpb.LookupPrefixRequest(model=model, block_size=BLOCK_SIZE,
                                        block_hashes=list(hashes)), timeout=10)
    except grpc.RpcError:
        return 0
    return max(reply.num_cached_blocks.values(), default=0)
