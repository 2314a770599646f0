"""pagoda.fault_injection: inert without PAGODA_FAULT_INJECT; with it, a fault fires on
the hits its spec names, in the processes and contexts (a rank, a group's life) it names,
and a rewritten spec file re-arms."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

import pagoda.fault_injection as fi


@pytest.fixture
def spec(tmp_path, monkeypatch):
    """Arm the module with a spec file; returns a function replacing its contents."""
    path = tmp_path / "faults.json"
    monkeypatch.setattr(fi, "_SPEC", f"@{path}")
    monkeypatch.setattr(fi, "_state", {"key": None, "faults": [], "hits": []})

    def write(*faults: dict) -> None:
        tmp = tmp_path / "tmp.json"
        tmp.write_text(json.dumps(list(faults)))
        os.replace(tmp, path)

    return write


def test_inert_without_the_variable(monkeypatch):
    monkeypatch.setattr(fi, "_SPEC", "")
    assert fi.check("kv_pull.block") is None
    assert fi.check("no.such.point") is None  # not even looked up


def test_after_and_times_count_hits(spec):
    spec({"point": "kv_pull.block", "action": "fail", "after": 2, "times": 2})
    assert [fi.check("kv_pull.block") for _ in range(5)] == [None, None, "fail", "fail", None]
    assert fi.check("worker.step") is None


def test_a_rewritten_spec_re_arms_and_an_empty_one_disarms(spec):
    spec({"point": "grammar.compile", "action": "fail"})
    assert fi.check("grammar.compile") == "fail"
    assert fi.check("grammar.compile") is None  # times 1: spent
    spec({"point": "grammar.compile", "action": "truncate", "times": 0})
    assert [fi.check("grammar.compile") for _ in range(3)] == ["truncate"] * 3
    spec()
    assert fi.check("grammar.compile") is None


def test_delay_sleeps_in_place(spec):
    spec({"point": "kv_pull.start", "action": "delay", "seconds": 0.2})
    started = time.monotonic()
    assert fi.check("kv_pull.start") == "delay"
    assert time.monotonic() - started >= 0.2


def test_process_filter_and_bad_specs(spec, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pagoda", "scheduler", '{"kv_role":"kv_consumer"}'])
    spec({"point": "worker.step", "process": "kv_producer"},
         {"point": "kv_fetch.start", "process": "kv_consumer"})
    assert fi.check("worker.step") is None
    assert fi.check("kv_fetch.start") == "fail"
    spec({"point": "worker.step", "action": "explode"})
    assert fi.check("worker.step") is None  # refused loudly, nothing armed
    with pytest.raises(ValueError):
        fi.check("no.such.point")


def test_context_must_match_and_only_matching_calls_count(spec):
    # A worker-group rank's 2nd step in the group's first life, once.
    spec({"point": "rank.step", "rank": 1, "generation": 0, "after": 1})
    assert fi.check("rank.step", rank=0, generation=0) is None  # another rank: no hit
    assert fi.check("rank.step", rank=1, generation=1) is None  # another life: no hit
    assert [fi.check("rank.step", rank=1, generation=0) for _ in range(3)] == [
        None, "fail", None]


def test_a_context_key_left_out_matches_every_value(spec):
    # A crash loop: rank 1 fails in every step of every life.
    spec({"point": "rank.step", "rank": 1, "times": 0})
    assert [fi.check("rank.step", rank=1, generation=g) for g in (0, 1, 2)] == ["fail"] * 3
    assert fi.check("rank.step", rank=2, generation=0) is None


def test_context_keys_are_checked(spec):
    spec({"point": "worker.step", "rank": 1})  # worker.step has no rank: refused
    assert fi.check("worker.step") is None
    spec({"point": "rank.step", "rank": 1, "after": "2"})  # not a count: refused
    assert fi.check("rank.step", rank=1, generation=0) is None
    with pytest.raises(ValueError):
        fi.check("rank.step", rank=1)  # a caller must pass the point's whole context
