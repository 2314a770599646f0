"""What a P/D decode replica is sent of a prompt's images: the same items without
pixels where the prefill's lease covers their runs, with them where it does not."""

from pagoda.kv_transfer.params import KVTransferParams
from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.services.gateway.disagg.media import decode_side_features


def item(offset, length, ident="a" * 64):
    return MultiModalFeature("image", ident, offset, length, data={"pixel_values": b"px"})


def lease(num_blocks):
    return KVTransferParams(do_remote_decode=True, block_hashes=[b"h"] * num_blocks)


def test_runs_inside_the_leased_blocks_go_without_pixels():
    features = [item(2, 8), item(12, 4, "b" * 64)]
    sent = decode_side_features(features, lease(4), 4)  # 16 tokens leased, runs end at 16
    assert [f.data for f in sent] == [None, None]
    assert [(f.identifier, f.offset, f.length) for f in sent] == \
        [(f.identifier, f.offset, f.length) for f in features]  # same block hashes
    assert features[0].data is not None  # the prefill side's request keeps its own


def test_a_run_past_the_lease_keeps_every_items_pixels():
    features = [item(2, 8), item(12, 5, "b" * 64)]  # ends at 17, in a block not leased
    assert all(f.data is not None for f in decode_side_features(features, lease(4), 4))
    assert all(f.data is not None for f in decode_side_features(features, lease(0), 4))


def test_a_prompt_without_images_is_unchanged():
    assert decode_side_features([], lease(3), 16) == []
