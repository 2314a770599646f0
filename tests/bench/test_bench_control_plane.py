"""`pagoda bench control-plane`'s own arithmetic: the worker's step record read back
within a window, idle gaps between steps, and the table it prints (no cluster)."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from pagoda.services.bench.control_plane import table
from pagoda.services.bench.serve_child import thread_cpu_samples, thread_cpu_seconds
from pagoda.services.common.thread_names import name_this_thread
from pagoda.services.bench.control_plane_load import (idle_gaps, last_step_end, prompt_text,
                                                     read_steps)
from pagoda.services.cli.main import build_parser


def test_steps_in_the_window_and_their_idle_gaps(tmp_path):
    record = tmp_path / "steps.txt"
    record.write_text("9.0 9.5 3 3\n10.0 10.025 128 128\n10.026 10.051 128 128\n"
                      "10.0535 10.0785 130 128\n11.5 11.6 1 1\n10.2 10.3")  # last: partial
    steps = read_steps(str(record), 10.0, 11.0)
    assert [s[2] for s in steps] == [128, 128, 130]
    assert idle_gaps(steps) == pytest.approx([0.001, 0.0025])
    assert read_steps(str(tmp_path / "missing.txt"), 0, 1) == []
    assert last_step_end(str(record)) == 11.6  # the partial line is skipped
    assert last_step_end(str(tmp_path / "missing.txt")) is None


def test_table_has_one_row_per_run_and_the_ratio_in_percent():
    row = {"step_ms": 25.0, "concurrency": 128, "tok_s": 4608.0, "ideal_tok_s": 5120.0,
           "ratio": 0.9, "mean_batch": 127.5, "idle_p50_ms": 0.4, "idle_p99_ms": 2.0,
           "sched_ms_per_step": 1.5, "gateway_us_per_token": 80.0, "itl_added_p50_ms": 1.0,
           "scheduler_threads_ms_per_step": {"engine-loop": 0.9, "event_engine": 0.4},
           "itl_added_p99_ms": 9.0, "cores": {"client": 0.5}, "errors": 0,
           "short_req_s": 310.0, "short_errors": 1}
    lines = table([row, {**row, "short_req_s": None, "idle_p50_ms": None}]).splitlines()
    assert len(lines) == 3
    cells = [c.strip() for c in lines[1].strip("|").split("|")]
    assert cells[:5] == ["25", "128", "4608", "5120", "90.0"]
    assert "0.40/2.00" in cells and "310" in cells and cells[-1] == "1"
    assert cells[7:9] == ["1.50", "0.90"]  # the process, then its engine thread
    assert "-/2.00" in lines[2]


def test_a_named_threads_cpu_is_counted_under_its_name():
    done = threading.Event()

    def spin():
        name_this_thread("bench-spinner")
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass
        done.wait()

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while thread_cpu_seconds([psutil.Process()]).get("bench-spinner", 0.0) < 0.25 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        # Its own 0.3 s of CPU, apart from the process's other threads.
        assert 0.25 <= thread_cpu_seconds([psutil.Process()]).get("bench-spinner", 0.0) < 0.5
    finally:
        done.set()
        thread.join()


def test_a_thread_started_by_a_named_one_counts_apart_from_it():
    """Linux copies a thread's native name to the threads it starts (as the engine loop's
    gRPC call-completion thread): the named thread's own CPU is not theirs."""
    done, child_spun = threading.Event(), threading.Event()

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def child():
        burn(0.3)
        child_spun.set()
        done.wait()

    def parent():
        name_this_thread("bench-parent")
        threading.Thread(target=child, daemon=True).start()  # inherits "bench-parent"
        burn(0.1)
        done.wait()

    thread = threading.Thread(target=parent)
    thread.start()
    try:
        assert child_spun.wait(10)
        time.sleep(0.05)  # the parent's 0.1 s is well done by now (or it waits its turn)
        deadline = time.monotonic() + 10
        while thread_cpu_seconds([psutil.Process()]).get("bench-parent", 0.0) < 0.38 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        apart = thread_cpu_seconds([psutil.Process()], one_thread_names=("bench-parent",))
        together = thread_cpu_seconds([psutil.Process()])
    finally:
        done.set()
        thread.join()
    assert 0.08 <= apart["bench-parent"] < 0.25  # the parent's 0.1 s alone
    assert 0.28 <= apart["bench-parent's threads"] < 0.5  # the child's 0.3 s
    assert 0.38 <= together["bench-parent"] < 0.7  # a name not listed: summed, as before
    assert "bench-parent's threads" not in together


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_since_a_sample_counts_each_thread_after_it():
    """Two threads of one name: one burns 0.3 s and ends before the window closes; the
    other burns 0.1 s before the window opens and 0.3 s inside it. The window holds the
    second's 0.3 s (summing by name before and after would give 0: the ended thread's
    CPU leaves /proc with it)."""
    ended_burnt, started_burnt, go, burnt_again, done = (threading.Event() for _ in range(5))

    def ending():
        name_this_thread("bench-pair")
        _burn(0.3)
        ended_burnt.set()

    def staying():
        name_this_thread("bench-pair")
        _burn(0.1)
        started_burnt.set()
        go.wait()
        _burn(0.3)
        burnt_again.set()
        done.wait()

    first, second = threading.Thread(target=ending), threading.Thread(target=staying)
    first.start()
    second.start()
    try:
        assert ended_burnt.wait(10) and started_burnt.wait(10)
        opened = thread_cpu_samples([psutil.Process()])
        first.join()
        go.set()
        assert burnt_again.wait(10)
        window = thread_cpu_seconds([psutil.Process()], since=opened)
    finally:
        go.set()
        done.set()
        second.join()
    assert 0.25 <= window["bench-pair"] < 0.38, window


def test_the_command_parses_subsets_and_prompts_differ():
    args = build_parser().parse_args(["bench", "control-plane", "--step-ms", "25",
                                      "--concurrency", "128,256", "--duration", "20"])
    assert (args.step_ms, args.concurrency, args.duration) == ([25.0], [128, 256], 20.0)
    assert prompt_text(1, 11) != prompt_text(2, 11)


@pytest.mark.parametrize("client", ["aiohttp", "httpx"])
def test_both_clients_count_the_same_stream_and_aiohttp_keeps_its_connections(client):
    """A stand-in server streams 4 tokens per request with continuous usage; each client
    counts every token and request in the window. aiohttp reads each body to its end,
    so its requests share a few connections; httpx stops at [DONE] (one each)."""
    import asyncio
    import json
    import time

    from aiohttp import web

    from pagoda.services.bench.control_plane_load import run_window

    peers: set = set()
    served = [0]

    async def completions(request):
        peers.add(request.transport.get_extra_info("peername"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(1, 5):
            chunk = {"choices": [{"index": 0, "text": f" t{n}"}],
                     "usage": {"prompt_tokens": 7, "completion_tokens": n}}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.005)
        await response.write(b"data: [DONE]\n\n")
        served[0] += 1
        return response

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            start = time.time()
            return await run_window(f"http://127.0.0.1:{port}/v1", "m", 2, 3, 4,
                                    start, start + 1.0, client)
        finally:
            await runner.cleanup()

    stats = asyncio.run(main())
    assert stats.errors == []
    assert stats.requests_done >= 10 and stats.tokens >= 4 * stats.requests_done
    assert stats.prompt_tokens and set(stats.prompt_tokens) == {7}
    assert stats.itl and min(stats.itl) > 0
    if client == "aiohttp":
        assert len(peers) <= 4 < served[0]  # kept-alive: far fewer connections than requests
    else:
        assert len(peers) >= served[0] - 2  # a new connection per request


@pytest.mark.parametrize("bench_flags,want", [
    ([], True),  # a CUDA device's default
    (["--no-async-scheduling"], False),
    (["--serve-args=--no-async-scheduling"], False),  # --serve-args win
])
def test_the_cluster_is_served_with_async_scheduling_unless_told_not_to(bench_flags, want):
    from pagoda.services.bench.control_plane import serve_flags

    parser = build_parser()
    bench = parser.parse_args(["bench", "control-plane", *bench_flags])
    serve = parser.parse_args(["serve", *serve_flags(bench, 15.0, "/tmp/steps.txt")])
    assert serve.async_scheduling is want
