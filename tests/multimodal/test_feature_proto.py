"""MultiModalFeature <-> proto: exact round trip, and every receiver's checks refuse a
feature whose bytes, shape, dtype, run or size is wrong."""

from __future__ import annotations

import pytest
import torch

from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services.common.protocol.multimodal import features_from_proto, features_to_proto

IDENT = "ab" * 32


def proto(features) -> spb.GenerateRequest:
    msg = spb.GenerateRequest()
    features_to_proto(features, msg.mm_features)
    return msg


def feature(**kw):
    base = dict(modality="image", identifier=IDENT, offset=2, length=4,
                data={"pixel_values": torch.randn(3, 5, 5),
                      "image_grid_thw": torch.tensor([1, 2, 2])})
    base.update(kw)
    return MultiModalFeature(**base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_tensors_round_trip_bit_for_bit(dtype):
    f = feature(data={"pixel_values": torch.randn(3, 4, 5).to(dtype)},
                is_embed=torch.tensor([True, False, True, True]))
    back = features_from_proto(proto([f]).mm_features, prompt_len=10)[0]
    assert back.data["pixel_values"].dtype == dtype
    assert torch.equal(back.data["pixel_values"], f.data["pixel_values"])
    assert torch.equal(back.is_embed, f.is_embed)
    assert (back.identifier, back.offset, back.length) == (IDENT, 2, 4)


def test_a_feature_without_data_stays_without_data():
    back = features_from_proto(proto([feature(data=None)]).mm_features, prompt_len=10)
    assert back[0].data is None


def test_the_gateway_forwards_proto_tensors_without_torch_conversion():
    msg = proto([feature()])
    kept = features_from_proto(msg.mm_features, 10, as_torch=False)
    again = proto(kept)
    assert again.mm_features[0] == msg.mm_features[0]


def corrupt(change):
    msg = proto([feature()])
    change(msg.mm_features[0])
    return msg.mm_features


@pytest.mark.parametrize("change,match", [
    (lambda f: setattr(f.data.tensors["pixel_values"], "data", b"\0" * 10), "needs 300 bytes"),
    (lambda f: f.data.tensors["pixel_values"].shape.append(1000), "needs 300000 bytes"),
    (lambda f: setattr(f.data.tensors["pixel_values"], "dtype", "complex64"), "dtype"),
    (lambda f: setattr(f, "offset", 8), "outside the prompt"),
    (lambda f: setattr(f, "length", 0), "empty"),
    (lambda f: setattr(f, "identifier", "x"), "sha256"),
    (lambda f: setattr(f, "modality", "smell"), "modality"),
])
def test_a_malformed_feature_is_refused(change, match):
    with pytest.raises(ValueError, match=match):
        features_from_proto(corrupt(change), prompt_len=10)


def test_the_size_limit_is_checked_on_receipt():
    msg = proto([feature()])
    with pytest.raises(ValueError, match="exceed the limit of 100 bytes"):
        features_from_proto(msg.mm_features, 10, max_bytes=100)


def test_overlapping_runs_are_refused():
    msg = proto([feature(offset=0), feature(offset=2)])
    with pytest.raises(ValueError, match="overlaps"):
        features_from_proto(msg.mm_features, prompt_len=10)


def test_a_worker_gets_pixels_only_for_items_it_must_encode():
    from pagoda.messages import CachedRequestData, NewRequestData, SchedulerOutput
    from pagoda.sampling_params import SamplingParams
    from pagoda.services.common.protocol.worker import (scheduler_output_from_proto,
                                                        scheduler_output_to_proto)
    first, second = feature(offset=0, length=4), feature(offset=6, length=4,
                                                         identifier="cd" * 32)
    new = NewRequestData(req_id="r", prompt_token_ids=list(range(12)), output_token_ids=[],
                         sampling_params=SamplingParams(max_tokens=1), block_ids=[0],
                         num_computed_tokens=4, mm_features=[first, second])
    out = SchedulerOutput(scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData(),
                          num_scheduled_tokens={"r": 8}, total_num_scheduled_tokens=8,
                          finished_req_ids=set(), preempted_req_ids=set())
    got = scheduler_output_from_proto(scheduler_output_to_proto(out)).scheduled_new_reqs[0]
    assert [f.identifier for f in got.mm_features] == [IDENT, "cd" * 32]
    assert got.mm_features[0].data is None  # its run [0, 4) is a prefix hit: no pixels
    assert torch.equal(got.mm_features[1].data["pixel_values"],
                       second.data["pixel_values"])
