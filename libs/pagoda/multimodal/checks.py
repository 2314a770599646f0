"""The request check for media (`pagoda.request_checks.check_request` calls it at each
trust boundary: the offline engine, the scheduler service)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pagoda.multimodal.inputs import MODALITIES
from pagoda.core.media_guard import MISSING_ENCODER_INPUT
from pagoda.multimodal.processing import POSITIONS_FROM_DATA, check_mm_limits, text_only_error

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.messages import EngineCoreRequest

_HEX_ID = re.compile(r"[0-9a-f]{16,128}")


def check_mm_features(request: EngineCoreRequest, config: EngineConfig) -> None:
    """ValueError for media sent to a text-only model (naming model and architecture),
    more items than --limit-mm-per-prompt, or features that break `MultiModalFeature`'s
    invariants (an unknown modality, a run outside the prompt or overlapping another, a
    malformed identifier, a run longer than the encoder budget, no encoder input).

    Items without encoder input (`data`) are taken only by a P/D decode side (its
    `kv_transfer_params` say do_remote_prefill: the prefill replica encoded them); the
    scheduler refuses such a request if it would have to compute any token of their
    runs itself (`pagoda.core.media_guard`)."""
    features = request.mm_features
    if not features:
        return
    if config.multimodal is None:
        raise text_only_error(config.arch.architecture, config.served_model_name[0]
                              if config.served_model_name else config.model)
    params = request.kv_transfer_params
    prefilled_elsewhere = params is not None and params.do_remote_prefill
    counts: dict[str, list] = {}
    previous_end = 0
    for i, f in enumerate(features):
        where = f"mm_features[{i}]"
        if f.modality not in MODALITIES:
            raise ValueError(f"{where}: unknown modality {f.modality!r}")
        if not isinstance(f.identifier, str) or not _HEX_ID.fullmatch(f.identifier):
            raise ValueError(f"{where}: identifier must be a hex content hash")
        if f.length <= 0 or f.offset < previous_end or f.end > len(request.prompt_token_ids):
            raise ValueError(f"{where}: placeholder run [{f.offset}, {f.end}) is outside the "
                             "prompt, empty, or overlaps/precedes the previous run")
        if f.data is None and config.arch.architecture in POSITIONS_FROM_DATA:
            # Worded as media_guard's refusal: the gateway then resends it with its data.
            raise ValueError(f"{where}: {f.modality} {f.identifier[:12]} "
                             f"{MISSING_ENCODER_INPUT}, and {config.arch.architecture} "
                             "computes its M-RoPE positions from the item's image_grid_thw "
                             "even where the prompt's KV was prefilled elsewhere")
        if f.data is None and not prefilled_elsewhere:
            raise ValueError(f"{where}: carries no encoder input (data); the worker that "
                             f"runs the prompt needs the {f.modality}'s tensors (only a "
                             "prefill/decode decode side, do_remote_prefill, goes without)")
        if f.is_embed is not None and len(f.is_embed) != f.length:
            raise ValueError(f"{where}: is_embed has {len(f.is_embed)} entries for a run of "
                             f"{f.length}")
        budget = config.scheduler.max_num_encoder_input_tokens
        if f.num_embeds > budget:
            raise ValueError(f"{where}: a {f.modality} of {f.num_embeds} encoder tokens "
                             f"exceeds max_num_encoder_input_tokens ({budget})")
        previous_end = f.end
        counts.setdefault(f.modality, []).append(f)
    check_mm_limits(counts, config.multimodal.limit_mm_per_prompt)
