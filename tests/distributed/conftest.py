"""Fixtures for the tensor/pipeline-parallel tests.

`run_ranks(world, fn, tp_size)` runs `fn(handles, rank)` on `world` threads of this
process, each a rank joined to real gloo groups over loopback: the collectives,
layers and model are tested as they run in a group, in milliseconds, without
starting processes. The offline tests start real groups (`mp`, and Ray in the slow
tests) through `pagoda.LLM`; their prompts and one-device reference are
`tests/group_cases.py`'s.
"""

from __future__ import annotations

import threading

import pytest


def run_ranks(world: int, fn, tp_size: int | None = None, timeout: float = 60.0) -> list:
    """Results of `fn(handles, rank)` for ranks 0..world-1, each on its own thread."""
    from pagoda.distributed.process_group import (GroupInit, connect_store, create_master_store,
                                                  join_group)

    tp_size = tp_size or world
    master = create_master_store("127.0.0.1", world, timeout)
    init = GroupInit("127.0.0.1", master.port, tp_size, world // tp_size, "cpu", timeout)
    results: list = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            store = master if rank == 0 else connect_store(init)
            results[rank] = fn(join_group(store, init, rank), rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


@pytest.fixture
def ranks():
    return run_ranks
