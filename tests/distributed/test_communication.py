"""The collectives over real gloo groups (ranks on threads of this process)."""

from __future__ import annotations

import torch

from pagoda.distributed.communication import (FRAME_BYTES, all_gather, all_reduce,
                                              broadcast_object, gather, min_over, recv_object,
                                              recv_tensor, send_object, send_tensor)


def test_tensor_collectives(ranks):
    def body(h, rank):
        tp = h.parallel.tp_group
        summed = all_reduce(torch.full((2, 3), float(rank + 1)), tp)
        gathered = all_gather(torch.full((2, 1), float(rank)), tp, 3)
        at_root = gather(torch.full((1, 2), float(rank)), tp, 3, rank)
        return summed, gathered, at_root, min_over(10 - rank, h.control)

    results = ranks(3, body)
    for summed, gathered, at_root, smallest in results:
        assert torch.equal(summed, torch.full((2, 3), 6.0))
        assert torch.equal(gathered, torch.tensor([[0.0, 1.0, 2.0]] * 2))
        assert smallest == 8
    assert torch.equal(results[0][2], torch.tensor([[0.0, 0.0, 1.0, 1.0, 2.0, 2.0]]))
    assert results[1][2] is None and results[2][2] is None


def test_objects_small_and_larger_than_one_frame(ranks):
    big = {"ids": list(range(FRAME_BYTES))}  # several frames' worth
    Plan = dict[str, int]  # noqa: N806 - a type, named like one
    Big = dict[str, list[int]]  # noqa: N806
    Result = tuple[str, Big]  # noqa: N806

    def body(h, rank):
        small = broadcast_object({"plan": rank} if rank == 0 else None, h.control, 0, rank, Plan)
        large = broadcast_object(big if rank == 0 else None, h.control, 0, rank, Big)
        if rank == 1:
            send_object(("result", big), h.control, 0, Result, tag=3)
            return small, large, None
        return small, large, recv_object(h.control, 1, Result, tag=3) if rank == 0 else None

    results = ranks(2, body)
    assert [r[0] for r in results] == [{"plan": 0}] * 2
    assert all(r[1] == big for r in results)
    assert results[0][2] == ("result", big)


def test_stage_to_stage_send_keeps_order_by_tag(ranks):
    # Two micro-batches in flight from stage 0 to stage 1, received by tag.
    def body(h, rank):
        pp = h.parallel.pp_group
        if rank == 0:
            works = [send_tensor(torch.full((2, 4), float(i)), pp, 1, tag=i) for i in range(2)]
            for w in works:
                w.wait()
            return None
        return [recv_tensor((2, 4), torch.float32, "cpu", pp, 0, tag=i)[0, 0].item()
                for i in range(2)]

    assert ranks(2, body, tp_size=1)[1] == [0.0, 1.0]


def test_the_rendezvous_store_listens_on_the_given_address_only():
    import psutil

    from pagoda.distributed.process_group import create_master_store

    store = create_master_store("127.0.0.1", 1, 10.0)
    store.set("k", "v")
    listening = {c.laddr for c in psutil.Process().net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port}
    assert {addr.ip for addr in listening} == {"127.0.0.1"}
    assert store.get("k") == b"v"
