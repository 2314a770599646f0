"""The Responses API's bounded store: least recently used out first."""

import pytest

from pagoda.services.gateway.openai.responses_api.store import ResponseStore, StoredResponse


def item(n: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}"}, [{"role": "user", "content": str(n)}])


def test_the_least_recently_used_response_is_dropped_first():
    store = ResponseStore(capacity=2)
    store.put("a", item(1))
    store.put("b", item(2))
    assert store.get("a").response == {"id": "resp_1"}  # a is now the most recent
    store.put("c", item(3))
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2


def test_capacity_zero_stores_nothing_and_negative_is_refused():
    store = ResponseStore(capacity=0)
    store.put("a", item(1))
    assert not store.enabled and store.get("a") is None and len(store) == 0
    with pytest.raises(ValueError):
        ResponseStore(capacity=-1)
