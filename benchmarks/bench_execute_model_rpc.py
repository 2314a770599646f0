"""What one step's ExecuteModel costs the scheduler process in gRPC, by call shape (not a
pytest file):

    .venv/bin/python benchmarks/bench_execute_model_rpc.py [--steps 1500] [unary bidi aio ...]

A stand-in worker (another process, generic handlers, a 2 ms "step", a 6 KB plan and a
3 KB reply: a batch-256 decode step's sizes) is driven as async scheduling drives the
real one: step N+1 is sent before N's reply is awaited (two in flight). The client's
CPU per step (`time.process_time`, every thread of the process: gRPC's C threads, the
channel's spin thread, the caller) is printed for each shape:

- unary: what `GrpcWorkerExecutor.submit_step` does, one `ExecuteModel.future()` per
  step and a done callback that resolves the engine's future;
- bidi: one long-lived stream-stream call on the sync channel, plans put on the
  request iterator's queue, replies read back in order;
- aio: one stream on a `grpc.aio` channel in an event-loop thread, the engine thread
  posting each plan with `call_soon_threadsafe`.

Measured on the 2-core machine (issue 28, interleaved, two sittings, load 1-5): unary
221-286 us, bidi 202-249 us, aio 259-426 us a step. A long-lived stream saves at most ~10% of the
call's CPU on the sync channel (its request iterator runs on a thread of its own, woken
per step, and its sends complete on the spin thread), so the unary call stays: about
0.02-0.05 ms of the served scheduler's ~3 ms a step, less than the run-to-run spread.

The same call costs more CPU the longer it waits (`--step-ms`; unary, stop 45, load ~1:
~290 us a step at 1 ms, ~435 at 10, ~525 at 50). Nothing polls while it waits (strace at
50 ms: ~12 futex and ~3 epoll_wait calls a call; ~8 thread wake-ups): the likeliest
cause is that a thread that slept for milliseconds on this 2-core VM, where the other
processes ran meanwhile, runs its next microseconds on cold caches. The served
scheduler's step costs ~2x its hot cost in one process (profile_scheduler_step.py) for
the same reason, and a step of a slow model (the CPU model's ~75 ms) costs the
scheduler as much as a 15 ms one.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import multiprocessing
import os
import queue
import sys
import threading
import time

import grpc

PLAN, REPLY = b"x" * 6000, b"y" * 3000


def _serve(ports, step_s: float) -> None:
    def unary(request, context):
        time.sleep(step_s)
        return REPLY

    def bidi(requests, context):
        for _ in requests:
            time.sleep(step_s)
            yield REPLY

    handler = grpc.method_handlers_generic_handler("bench.Worker", {
        "Step": grpc.unary_unary_rpc_method_handler(unary),
        "Steps": grpc.stream_stream_rpc_method_handler(bidi)})
    server = grpc.server(cf.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((handler,))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def unary_steps(address: str):
    channel = grpc.insecure_channel(address)
    step = channel.unary_unary("/bench.Worker/Step")

    def send() -> cf.Future:
        result: cf.Future = cf.Future()
        step.future(PLAN).add_done_callback(lambda call: result.set_result(call.result()))
        return result
    return send


def bidi_steps(address: str):
    plans: queue.SimpleQueue = queue.SimpleQueue()
    replies = grpc.insecure_channel(address).stream_stream("/bench.Worker/Steps")(
        iter(plans.get, None))
    pending: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        for reply in replies:
            pending.get().set_result(reply)
    threading.Thread(target=read, daemon=True).start()

    def send() -> cf.Future:
        result: cf.Future = cf.Future()
        pending.put(result)
        plans.put(PLAN)
        return result
    return send


def aio_steps(address: str):
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    pending: list[cf.Future] = []
    plans: asyncio.Queue

    async def start() -> None:
        nonlocal plans
        plans = asyncio.Queue()
        call = grpc.aio.insecure_channel(address).stream_stream("/bench.Worker/Steps")()

        async def write() -> None:
            while True:
                await call.write(await plans.get())

        async def read() -> None:
            while (reply := await call.read()) is not grpc.aio.EOF:
                pending.pop(0).set_result(reply)
        loop.create_task(write())
        loop.create_task(read())
    asyncio.run_coroutine_threadsafe(start(), loop).result()

    def send() -> cf.Future:
        result: cf.Future = cf.Future()

        def post() -> None:
            pending.append(result)
            plans.put_nowait(PLAN)
        loop.call_soon_threadsafe(post)
        return result
    return send


def run(send, steps: int) -> None:
    """Two in flight: send step N+1, then wait for N."""
    previous = send()
    for _ in range(steps - 1):
        following = send()
        previous.result()
        previous = following
    previous.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--step-ms", type=float, default=2.0,
                        help="The stand-in worker's step (default 2 ms).")
    parser.add_argument("shapes", nargs="*", default=["unary", "bidi", "aio"])
    args = parser.parse_args()
    ports = multiprocessing.Queue()
    worker = multiprocessing.Process(target=_serve, args=(ports, args.step_ms / 1000), daemon=True)
    worker.start()
    address = f"127.0.0.1:{ports.get(timeout=30)}"
    shapes = {"unary": unary_steps, "bidi": bidi_steps, "aio": aio_steps}
    for shape in args.shapes:
        send = shapes[shape](address)
        run(send, 100)  # warm: the channel connected, the threads started
        cpu, wall = time.process_time(), time.perf_counter()
        run(send, args.steps)
        print(f"{shape:6s} client CPU {(time.process_time() - cpu) / args.steps * 1e6:6.0f} us"
              f"/step, wall {(time.perf_counter() - wall) / args.steps * 1e6:6.0f} us/step")
    worker.kill()
    sys.stdout.flush()
    os._exit(0)  # the shapes' channels, streams and loop threads are left as they are


if __name__ == "__main__":
    main()
