"""`MultiModalFeature`: one media item of one prompt, after the HF processor.

A prompt with media is its expanded token ids plus one feature per item, in prompt
order. Each item owns a run of placeholder tokens in `prompt_token_ids`:

    prompt_token_ids:  BOS  U  S  E  R  :  <im> <im> <im> ... <im>  \\n  W  h  a  t
                                          ^offset                      (offset + length)
                                          └──────── length ──────────┘

The model computes the item's encoder output once (the vision tower + projector for an
image) and scatters its rows into the text embeddings at the run's positions; the
scheduler keys the prefix-cache blocks overlapping the run with `identifier`.

This module imports no torch at import time (the gateway and the tokenizer service's
CLI may import it); `data` holds torch tensors only once a processor has filled it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IMAGE = "image"
# The modalities the contract is shaped for; only IMAGE has processors and encoders so
# far. A video is one item whose run covers all its frames (Qwen2-VL's `video_grid_thw`),
# an audio clip one item whose run covers its frames: the same offset/length/identifier.
MODALITIES = (IMAGE, "video", "audio")


@dataclass
class MultiModalFeature:
    """One media item of one prompt after the HF processor.

    Invariants:
      * `modality` is one of MODALITIES ("image" today).
      * `identifier` is the hex content hash (sha256) of the decoded item (an image's
        mode, size and pixel bytes; an embedding tensor's dtype, shape and bytes) and the
        `mm_processor_kwargs` that processed it. Equal identifiers mean equal encoder
        outputs: it keys the worker's encoder cache, the processor cache and the
        prefix-cache block hashes (`pagoda.core.block_hash.mm_block_keys`).
      * `prompt_token_ids[offset:offset + length]` is the item's placeholder run; runs of
        one prompt never overlap and are sorted by `offset`.
      * `is_embed` (bool [length]) marks the run's positions that take an encoder row
        (vLLM's `is_embed`); None means every position does. The encoder output of the
        item has exactly `num_embeds` rows, in run order.
      * `data` holds this item's processor outputs only, each tensor being the item's
        slice of the processor's batch with the leading item axis removed
        (LLaVA: `pixel_values` [3, H, W]; Qwen2-VL: `pixel_values` [patches, dim] and
        `image_grid_thw` [3]); or `image_embeds` [num_embeds, hidden] for an embedding
        input, which the model uses as the encoder output itself. `data` is None where
        the receiver needs no pixels (a decode-only replica, a scheduler, a router): the
        identifier and the run are all they use.
    """

    modality: str
    identifier: str
    offset: int
    length: int
    data: dict[str, "torch.Tensor"] | None = None
    is_embed: "torch.Tensor | None" = None

    @property
    def num_embeds(self) -> int:
        """Rows of the item's encoder output (vLLM's `get_num_embeds`)."""
        return self.length if self.is_embed is None else int(self.is_embed.sum())

    @property
    def end(self) -> int:
        """One past the run's last position."""
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether the run meets token positions [start, end)."""
        return self.offset < end and start < self.end

    def without_data(self) -> "MultiModalFeature":
        """The same item with `data` dropped (for receivers that need no pixels)."""
        return MultiModalFeature(self.modality, self.identifier, self.offset, self.length,
                                 None, self.is_embed)
