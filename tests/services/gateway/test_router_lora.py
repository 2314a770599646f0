"""Adapter placement: an adapter's requests go where it is loaded, spill over only when
every holder has a queue, and never go to replicas without LoRA."""

from __future__ import annotations

from types import SimpleNamespace

from pagoda.services.gateway.routing.lora_placement import AdapterPlacement


def replica(address: str, held=(), waiting: int = 0, max_cpu_loras: int = 2):
    return SimpleNamespace(address=address,
                           load=SimpleNamespace(lora_adapters=list(held), num_waiting=waiting),
                           info=SimpleNamespace(max_cpu_loras=max_cpu_loras))


def addresses(replicas) -> set[str]:
    return {r.address for r in replicas}


def test_holders_first_then_room_then_anyone():
    placement = AdapterPlacement()
    a, b, c = replica("a", ["sql"]), replica("b", ["x", "y"]), replica("c")
    assert addresses(placement.candidates([a, b, c], "sql")) == {"a"}
    # Nobody holds "chat": the replicas with room to load it (b is full).
    assert addresses(placement.candidates([a, b, c], "chat")) == {"a", "c"}
    full = [replica("a", ["x", "y"]), replica("b", ["z", "w"])]
    assert addresses(placement.candidates(full, "chat")) == {"a", "b"}


def test_a_hot_adapter_spills_over_when_every_holder_has_a_queue():
    placement = AdapterPlacement()
    busy, idle = replica("a", ["sql"], waiting=6), replica("b")
    assert addresses(placement.candidates([busy, idle], "sql")) == {"a", "b"}
    calm = replica("a", ["sql"], waiting=1)  # one waiting for the next step: normal
    assert addresses(placement.candidates([calm, idle], "sql")) == {"a"}


def test_recent_routes_count_as_held_until_the_replica_reports():
    placement = AdapterPlacement()
    a, b = replica("a"), replica("b")
    placement.record("b", "sql", now=100.0)
    assert addresses(placement.candidates([a, b], "sql", now=101.0)) == {"b"}
    assert addresses(placement.candidates([a, b], "sql", now=200.0)) == {"a", "b"}


def test_replicas_without_lora_get_no_adapter_request():
    placement = AdapterPlacement()
    plain, lora = replica("a", max_cpu_loras=0), replica("b")
    assert addresses(placement.candidates([plain, lora], "sql")) == {"b"}
    # With none able to, the request still goes somewhere: that replica refuses it.
    assert addresses(placement.candidates([plain], "sql")) == {"a"}
