"""The worker's asynchronous onloads: tier blocks copied into device blocks in the
background while steps run (`SchedulerOutput.kv_async_onloads`, the default
`--kv-offloading-onload async`).

    step N   apply: spills, drops, offloads, sync onloads | submit(N's async onloads)
             forward ...                      || loader thread: verify + copy, job by job
             poll -> finished_recving / invalid_block_ids (every rank agreed)
    step N+k the scheduler admits the reported requests; they compute only the rest

One job per request, run in submission order by one thread (on CUDA on a side
stream, which first waits for the step stream's work so far, and is synchronized
before the job counts as done). Each block is verified as the synchronous path does
(hash and CRC-32 of the host slot, the disk record's checks); a block that fails is
not copied and is reported invalid.

Invariants:
  * the copies write only the job's device blocks, which belong to a request in no
    batch and are never freed or reused before the job is reported (the scheduler);
    they read only host slots and disk records the scheduler holds until then;
  * every rank of a TP/PP group submits the same jobs in the same order and removes
    them at the same step: a job is reported only once every rank finished it, and a
    block is invalid if any rank failed it (`poll`'s `agree`, one MAX all-reduce
    over one flag per block: 2 not done here, 1 failed here, 0 copied);
  * after `void` (the device cache was set up again) every block of the jobs then in
    flight is reported invalid: their copies land in a cache no longer used.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from pagoda.messages import KVOnload

logger = logging.getLogger(__name__)
NOT_DONE, FAILED, COPIED = 2, 1, 0


@dataclass
class _Job:
    req_id: str
    ops: list[KVOnload]
    kv_caches: list
    ready: object = None  # a CUDA event on the step stream the copies wait for
    failed: set[int] = field(default_factory=set)  # device block ids not filled
    void: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class AsyncOnloader:
    """Runs `tier`'s onloads (a `HostKVTier`) on a background thread."""

    def __init__(self, tier) -> None:
        self.tier = tier
        self._jobs: list[_Job] = []  # submitted, not yet reported; in order
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stream = None

    @property
    def pending(self) -> bool:
        """Jobs submitted and not reported (the same on every rank)."""
        return bool(self._jobs)

    def submit(self, kv_caches, ops: list[KVOnload]) -> None:
        """Start `ops` (after this step's offloads, which the caller ran and synchronized)."""
        by_req: dict[str, list[KVOnload]] = {}
        for op in ops:
            by_req.setdefault(op.req_id, []).append(op)
        device = kv_caches[0][0].device
        ready = None
        if device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-onload", daemon=True)
            self._thread.start()
        for req_id, req_ops in by_req.items():
            job = _Job(req_id, req_ops, kv_caches, ready)
            self._jobs.append(job)
            self._queue.put(job)

    def poll(self, agree=None, wait_s: float = 0.0) -> tuple[set[str], set[int]]:
        """(requests whose jobs every rank finished, their device blocks any rank failed);
        those jobs are forgotten. `wait_s`: first wait that long for the oldest job
        (a step with nothing else to do). `agree`: the group's MAX all-reduce of a list
        of ints (`ModelRunner._agree_on_onloads`); None for one rank."""
        if not self._jobs:
            return set(), set()
        if wait_s > 0:
            self._jobs[0].done.wait(wait_s)
        flags = []
        for job in self._jobs:
            done = job.done.is_set()
            for op in job.ops:
                flags.append(NOT_DONE if not done
                             else FAILED if job.void or op.block_id in job.failed else COPIED)
        if agree is not None:
            flags = agree(flags)
        finished, invalid, kept = set(), set(), []
        i = 0
        for job in self._jobs:
            job_flags = flags[i:i + len(job.ops)]
            i += len(job.ops)
            if max(job_flags) == NOT_DONE:
                kept.append(job)
                continue
            finished.add(job.req_id)
            invalid.update(op.block_id for op, flag in zip(job.ops, job_flags) if flag == FAILED)
        self._jobs = kept
        return finished, invalid

    def void(self) -> None:
        """The device cache was set up again: every job in flight reports failure."""
        for job in self._jobs:
            job.void = True

    def drain(self) -> None:
        """Wait for every job in flight and make it report failure (the worker forgets
        its requests: a failed step, a restarted scheduler); afterwards nothing writes
        the device cache. The jobs are still reported, so a scheduler that waits for
        them recomputes, and one that never knew them ignores the report."""
        for job in self._jobs:
            job.done.wait()
            job.void = True

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._copy(job)
            except Exception:  # noqa: BLE001 - a failed copy is recomputed, never fatal
                logger.exception("KV tier: an asynchronous onload failed; recomputing it")
                job.failed = {op.block_id for op in job.ops}
            job.done.set()

    def _copy(self, job: _Job) -> None:
        start = time.perf_counter()
        stream = self._stream
        if stream is not None:
            stream.wait_event(job.ready)
            with torch.cuda.stream(stream):
                job.failed = self.tier.onload_blocks(job.kv_caches, job.ops)
            stream.synchronize()
        else:
            job.failed = self.tier.onload_blocks(job.kv_caches, job.ops)
        self.tier.add_async_seconds(time.perf_counter() - start)


def with_reports(output, finished: set[str], invalid: set[int]):
    """`output` (a ModelRunnerOutput, possibly shared: `empty()`) carrying the reports."""
    if not finished:
        return output
    return dataclasses.replace(output, finished_recving=finished, invalid_block_ids=invalid)
