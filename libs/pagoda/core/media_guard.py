"""The rule for media items that came without their encoder input (a P/D decode side).

A disaggregated decode replica gets a prompt's media items without `data` (no pixels:
`MultiModalFeature.without_data()`); their identifiers still key its block hashes, so
the prompt's KV, imported from the prefill replica, is found as a prefix-cache hit.
Such a replica must never compute a token inside one of those items' placeholder runs:
the model would read placeholder embeddings where the encoder's rows belong and answer
wrongly. Whenever a step would (an import that fell short, a failed pull, a recompute
after preemption, a run that reaches into the prompt's partial last block, which no
lease covers), the scheduler ends the request (ABORT, with `failure` naming the item)
instead (the stream ends INVALID_ARGUMENT with this text, before any output). The
gateway, which holds the pixels, sends them whenever the decode replica is to compute
the prompt itself (no prefill replica, a failed prefill, a lease short of a run), and
sends the request again with them when a decode replica refuses it this way: only a
replica told that its prompt was prefilled elsewhere gets items without data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# In every refusal's text: how a caller (the gateway) tells this refusal from others.
MISSING_ENCODER_INPUT = "arrived without its encoder input"


def missing_encoder_input(mm_features: Sequence[Any], start: int, num_new: int) -> str | None:
    """Why tokens [start, start + num_new) cannot be computed here: the first item
    without data whose placeholder run they meet; None when they can."""
    end = start + num_new
    for feature in mm_features:
        if feature.offset >= end:
            break  # sorted by offset: the rest lie beyond these tokens
        if feature.data is None and start < feature.offset + feature.length:
            return (f"{feature.modality} {feature.identifier[:12]} {MISSING_ENCODER_INPUT} "
                    f"(prefill/decode disaggregation: the prefill replica "
                    f"encodes it), but tokens [{start}, {end}) of this request, inside its "
                    f"placeholder run [{feature.offset}, {feature.offset + feature.length}), "
                    "would have to be computed here: the prompt's imported KV did not cover "
                    "them. Refused rather than computed without the image.")
    return None
