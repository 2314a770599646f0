"""Prompt + media -> expanded prompt token ids + `MultiModalFeature`s: one function,
`process_prompt`, which the offline `LLM` and the tokenizer service both call.

    processor = load_mm_processor(model_dir, tokenizer)        # None: a text-only model
    processed = process_prompt(processor, prompt, {"image": [img1, img2]},
                               mm_processor_kwargs, limit_mm_per_prompt={"image": 4},
                               cache=ProcessorCache.from_gb(4))
    EngineCoreRequest(..., prompt_token_ids=processed.prompt_token_ids,
                      mm_features=processed.mm_features)

The prompt (text after the chat template, or token ids) names each item once with the
model's placeholder token (`<image>`), in the order of the media list; `process_prompt`
expands each placeholder into the item's run (a run that is already expanded to the
right length is kept). Items are processed one at a time with the model's HF image
processor (transformers' PIL backend: torchvision is not needed), so one item's tensors
never depend on its neighbours and the processor cache can key them by content hash.

The family-specific part (what the HF processor returns per item, how many placeholder
positions an item takes) is a `MultiModalProcessor` subclass per architecture; the
family's processor module is named in `_FAMILY_PROCESSORS` and imported on first use.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.multimodal.inputs import IMAGE, MultiModalFeature

# vLLM's default for a modality --limit-mm-per-prompt leaves out.
DEFAULT_LIMIT_PER_PROMPT = 999

# HF architecture -> "module:Class" of its processor (imported on first use).
_FAMILY_PROCESSORS = {
    "LlavaForConditionalGeneration": "pagoda.multimodal.llava_processing:LlavaProcessor",
    "Qwen2VLForConditionalGeneration": "pagoda.multimodal.qwen2_vl_processing:Qwen2VLProcessor",
    "Qwen2_5_VLForConditionalGeneration":
        "pagoda.multimodal.qwen2_vl_processing:Qwen2VLProcessor",
    "Idefics3ForConditionalGeneration":
        "pagoda.multimodal.idefics3_processing:Idefics3Processor",
}


@dataclass
class ProcessedPrompt:
    """A prompt ready for `EngineCoreRequest`: expanded token ids and one feature per
    item, sorted by offset (see `MultiModalFeature`'s invariants)."""

    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature]


class MultiModalProcessor:
    """One architecture's preprocessing: the HF image processor and the placeholder rule.

    Subclasses set `placeholder_token_ids` (modality -> token id of its run) and
    implement `process_image` and `num_embeds`. `hf_config` is the model's config.json
    as a dict; `tokenizer` encodes text prompts.
    """

    architecture: str = ""
    placeholder_token_ids: dict[str, int] = {}

    def __init__(self, model_dir: str, hf_config: dict, tokenizer: Any) -> None:
        self.model_dir = model_dir
        self.hf_config = hf_config
        self.tokenizer = tokenizer

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.placeholder_token_ids)

    def process_image(self, image: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """One PIL image -> its tensors (leading item axis removed)."""
        raise NotImplementedError

    def num_embeds(self, data: Mapping[str, Any]) -> int:
        """Rows of the encoder output of one item's data."""
        raise NotImplementedError

    def placeholder_run(self, modality: str, data: Mapping[str, Any]) -> list[int]:
        """The item's run of token ids (what its one placeholder expands to). Default:
        `num_embeds` copies of the placeholder token, each taking an encoder row. A
        family whose run interleaves text tokens (Idefics3's tile markers) overrides it;
        the positions holding the placeholder token are then the `is_embed` ones, and
        there must be exactly `num_embeds` of them."""
        return [self.placeholder_token_ids[modality]] * self.num_embeds(data)

    def embeds_data(self, embeds: Any) -> dict[str, Any]:
        """One item's precomputed embeddings (`image_embeds` [rows, hidden]); a family
        whose runs need more than the rows (Qwen2-VL's grid) overrides it."""
        import torch  # lazy: importing this module costs no torch (flag parsers use it)
        if isinstance(embeds, Mapping):
            raise ValueError(f"{self.architecture} takes image_embeds alone; got "
                             f"{sorted(embeds)} (image_grid_thw is Qwen2-VL's)")
        if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2:
            raise ValueError("image_embeds must be a tensor [num_image_tokens, hidden_size] "
                             "per image (or [num_images, num_image_tokens, hidden_size])")
        hidden = self.text_hidden_size
        if hidden is not None and embeds.shape[1] != hidden:
            raise ValueError(f"image_embeds have hidden size {embeds.shape[1]}; "
                             f"{self.architecture} takes {hidden}")
        return {"image_embeds": embeds}

    @property
    def text_hidden_size(self) -> int | None:
        text = self.hf_config.get("text_config") or self.hf_config
        return text.get("hidden_size")


def load_mm_processor(model_dir: str, tokenizer: Any = None) -> MultiModalProcessor | None:
    """The processor of the model in local directory `model_dir` (resolve a hub id first:
    `pagoda.model.hub.download(..., kind="tokenizer")` fetches the processor files too),
    or None when the model takes no media (a text-only architecture)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        hf_config = json.load(f)
    for architecture in hf_config.get("architectures") or []:
        if architecture in _FAMILY_PROCESSORS:
            module, name = _FAMILY_PROCESSORS[architecture].split(":")
            cls = getattr(importlib.import_module(module), name)
            if tokenizer is None:
                # lazy: callers that pass their tokenizer never load transformers here
                from pagoda.tokenizer.loader import load_tokenizer
                tokenizer = load_tokenizer(model_dir)
            return cls(model_dir, hf_config, tokenizer)
    return None


# Families whose placeholder runs take positions from the item's data (M-RoPE reads each
# image's grid): a receiver that computes positions needs the data even when it encodes
# nothing, so such items never travel without it.
POSITIONS_FROM_DATA = frozenset({"Qwen2VLForConditionalGeneration",
                                 "Qwen2_5_VLForConditionalGeneration"})


def is_multimodal_architecture(architecture: str) -> bool:
    return architecture in _FAMILY_PROCESSORS


def text_only_error(architecture: str, model: str | None = None) -> ValueError:
    """The error for media sent to a model that takes none (names model and architecture)."""
    which = f"{model!r} ({architecture})" if model else architecture
    return ValueError(f"Model {which} is a text-only model and does not accept multi-modal "
                      f"data (images); multi-modal architectures: "
                      f"{', '.join(sorted(_FAMILY_PROCESSORS))}")


def parse_limit_mm_per_prompt(value: str | Mapping[str, int] | None) -> dict[str, int]:
    """`--limit-mm-per-prompt` ('{"image": 2}' or a dict) -> {modality: limit}."""
    if value is None or value == "":
        return {}
    limits = json.loads(value) if isinstance(value, str) else dict(value)
    if not isinstance(limits, dict):
        raise ValueError(f"limit_mm_per_prompt must be a JSON object like '{{\"image\": 2}}'; "
                         f"got {value!r}")
    for modality, limit in limits.items():
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be an integer >= 0; "
                             f"got {limit!r}")
    return limits


def normalize_mm_data(mm_data: Mapping[str, Any]) -> dict[str, list[Any]]:
    """`multi_modal_data` -> {modality: [item, ...]}: one item or a list per modality;
    a 3-D embedding tensor [num_images, tokens, hidden] is one item per image, a dict
    `{"image_embeds": t}` is that tensor's items."""
    if not isinstance(mm_data, Mapping):
        raise ValueError(f"multi_modal_data must be a dict like {{'image': image}}; "
                         f"got {type(mm_data).__name__}")
    out: dict[str, list[Any]] = {}
    for modality, value in mm_data.items():
        if isinstance(value, Mapping):
            if "image_embeds" not in value or set(value) - {"image_embeds", "image_grid_thw"}:
                raise ValueError(f"multi_modal_data[{modality!r}] as a dict takes "
                                 f"'image_embeds' (and, for Qwen2-VL, 'image_grid_thw'); "
                                 f"got {sorted(value)}")
            if "image_grid_thw" in value:
                out[modality] = _embeds_per_grid(value["image_embeds"], value["image_grid_thw"])
                continue
            value = value["image_embeds"]
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        flat: list[Any] = []
        for item in items:
            if getattr(item, "dim", None) is not None and item.dim() == 3:
                flat.extend(item.unbind(0))
            else:
                flat.append(item)
        out[modality] = flat
    return out


def _embeds_per_grid(embeds: Any, grids: Any) -> list[dict[str, Any]]:
    """vLLM's Qwen2-VL embedding input: `image_embeds` [rows of all images, hidden] (or
    a list, one tensor per image) with `image_grid_thw` [images, 3] -> one
    {"image_embeds", "image_grid_thw"} item per image. Each image's rows are
    proportional to its grid's t*h*w (all share one merge size); the processor checks
    the exact count."""
    import torch  # lazy: importing this module costs no torch (flag parsers use it)
    if not isinstance(grids, torch.Tensor):
        grids = torch.as_tensor(grids)
    grids = grids.reshape(-1, 3).long()
    sizes = [int(g.prod()) for g in grids]
    if isinstance(embeds, (list, tuple)):
        parts = list(embeds)
    elif isinstance(embeds, torch.Tensor) and embeds.dim() == 2 and sum(sizes) > 0 \
            and all(embeds.shape[0] * n % sum(sizes) == 0 for n in sizes):
        parts = list(embeds.split([embeds.shape[0] * n // sum(sizes) for n in sizes]))
    else:
        raise ValueError("image_embeds must be a tensor [rows of all images, hidden_size] "
                         "(or a list of one per image) whose rows split by image_grid_thw")
    if len(parts) != len(grids):
        raise ValueError(f"{len(parts)} image_embeds tensors for {len(grids)} image_grid_thw rows")
    return [{"image_embeds": e, "image_grid_thw": g} for e, g in zip(parts, grids)]


def check_mm_limits(items: Mapping[str, Sequence[Any]], limits: Mapping[str, int] | None) -> None:
    """ValueError (vLLM's wording) if a modality has more items than its limit."""
    for modality, values in items.items():
        limit = (limits or {}).get(modality, DEFAULT_LIMIT_PER_PROMPT)
        if len(values) > limit:
            raise ValueError(f"At most {limit} {modality}(s) may be provided in one prompt; "
                             f"got {len(values)} (--limit-mm-per-prompt)")


def content_identifier(modality: str, item: Any, kwargs: Mapping[str, Any] | None) -> str:
    """Hex sha256 of a decoded item (PIL image or tensor) and its processor kwargs."""
    h = hashlib.sha256(modality.encode())
    if hasattr(item, "tobytes") and hasattr(item, "mode"):  # a PIL image
        h.update(f"pil:{item.mode}:{item.size}".encode())
        h.update(item.tobytes())
    else:  # a tensor of embeddings
        t = item.detach().cpu().contiguous()
        h.update(f"tensor:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(memoryview(t.view(-1).view(_uint8(t)).numpy()))
    h.update(json.dumps(dict(kwargs or {}), sort_keys=True, default=repr).encode())
    return h.hexdigest()


def _uint8(t: Any) -> Any:
    import torch  # lazy: importing this module costs no torch (flag parsers use it)
    return torch.uint8


class ProcessorCache:
    """LRU of processor outputs keyed by `identifier` (vLLM's `--mm-processor-cache-gb`).

    Invariant: the summed tensor bytes of the entries stay <= `capacity_bytes`; an item
    larger than the whole cache is never stored.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0
        self.queries = 0

    @classmethod
    def from_gb(cls, gb: float) -> "ProcessorCache | None":
        """None when `gb` is 0 (the cache is off)."""
        return cls(int(gb * 2**30)) if gb and gb > 0 else None

    def get(self, identifier: str) -> dict[str, Any] | None:
        self.queries += 1
        entry = self._entries.get(identifier)
        if entry is None:
            return None
        self.hits += 1
        self._entries.move_to_end(identifier)
        return entry[0]

    def put(self, identifier: str, data: dict[str, Any]) -> None:
        size = sum(t.numel() * t.element_size() for t in data.values())
        if size > self.capacity_bytes or identifier in self._entries:
            return
        while self.num_bytes + size > self.capacity_bytes:
            _, (_, freed) = self._entries.popitem(last=False)
            self.num_bytes -= freed
        self._entries[identifier] = (data, size)
        self.num_bytes += size


def process_prompt(processor: MultiModalProcessor | None, prompt: str | Sequence[int],
                   mm_data: Mapping[str, Any] | None,
                   mm_processor_kwargs: Mapping[str, Any] | None = None, *,
                   add_special_tokens: bool = True,
                   limit_mm_per_prompt: Mapping[str, int] | None = None,
                   cache: ProcessorCache | None = None,
                   architecture: str = "") -> ProcessedPrompt:
    """Tokenize (a text prompt), process each media item and expand its placeholder.

    ValueError, naming what is wrong, for: media sent to a text-only model (`processor`
    None; `architecture` names it), an unsupported modality, too many items, a
    placeholder count that differs from the item count, bad embeddings.
    """
    items = normalize_mm_data(mm_data or {})
    if processor is None:
        if any(items.values()):
            raise text_only_error(architecture or "this architecture")
        ids = _encode(None, prompt, add_special_tokens)
        return ProcessedPrompt(ids, [])
    for modality in items:
        if modality not in processor.modalities:
            raise ValueError(f"{processor.architecture} does not accept {modality!r} inputs; "
                             f"it accepts {', '.join(processor.modalities)}")
    check_mm_limits(items, limit_mm_per_prompt)
    ids = _encode(processor.tokenizer, prompt, add_special_tokens)
    kwargs = dict(mm_processor_kwargs or {})
    features: list[MultiModalFeature] = []
    for modality, values in items.items():
        datas = [_item_data(processor, modality, v, kwargs, cache) for v in values]
        token_id = processor.placeholder_token_ids[modality]
        item_runs = [processor.placeholder_run(modality, d) for d, _ in datas]
        ids, runs = _expand_placeholders(ids, token_id, item_runs, modality)
        # An earlier modality's runs shift when this one's placeholders expand before them.
        features = _shift(features, runs)
        features += [MultiModalFeature(modality, ident, offset, length, data,
                                       _is_embed(run, token_id, processor.num_embeds(data)))
                     for (data, ident), (offset, length), run in zip(datas, runs, item_runs)]
    features.sort(key=lambda f: f.offset)
    return ProcessedPrompt(ids, features)


def _encode(tokenizer: Any, prompt: str | Sequence[int], add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs the model's tokenizer")
        return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    return [int(t) for t in prompt]


def _item_data(processor: MultiModalProcessor, modality: str, item: Any,
               kwargs: Mapping[str, Any], cache: ProcessorCache | None
               ) -> tuple[dict[str, Any], str]:
    import torch  # lazy: importing this module costs no torch (flag parsers use it)
    if isinstance(item, torch.Tensor):
        return processor.embeds_data(item), content_identifier(modality, item, kwargs)
    if isinstance(item, Mapping):  # embeddings with the metadata their run needs
        data = processor.embeds_data(item)
        extra = {k: v.tolist() for k, v in data.items() if k != "image_embeds"}
        return data, content_identifier(modality, data["image_embeds"], {**kwargs, **extra})
    if not (hasattr(item, "tobytes") and hasattr(item, "mode")):
        raise ValueError(f"multi_modal_data[{modality!r}] items must be PIL images or "
                         f"embedding tensors; got {type(item).__name__}")
    identifier = content_identifier(modality, item, kwargs)
    data = cache.get(identifier) if cache is not None else None
    if data is None:
        data = processor.process_image(item, kwargs)
        if cache is not None:
            cache.put(identifier, data)
    return data, identifier


def _is_embed(run: list[int], token_id: int, num_embeds: int) -> Any:
    """The run's `is_embed` mask (None when every position takes an encoder row)."""
    import torch  # lazy: importing this module costs no torch (flag parsers use it)
    mask = torch.tensor([t == token_id for t in run], dtype=torch.bool)
    if int(mask.sum()) != num_embeds:
        raise ValueError(f"a placeholder run holds {int(mask.sum())} placeholder tokens for "
                         f"{num_embeds} encoder rows")
    return None if bool(mask.all()) else mask


def _expand_placeholders(ids: list[int], token_id: int, item_runs: list[list[int]],
                         modality: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Expand the i-th placeholder to `item_runs[i]` (a run already expanded in the
    prompt is kept). Returns the new ids and each item's (offset, length)."""
    out: list[int] = []
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        run = item_runs[len(runs)] if len(runs) < len(item_runs) else None
        n = len(run) if run is not None else 0
        if run is not None and n > 1 and ids[i:i + n] == run:
            i += n  # already expanded (a prompt_token_ids prompt from HF's processor)
        elif ids[i] == token_id:
            if run is None:
                raise ValueError(f"the prompt has more {modality} placeholders than the "
                                 f"{len(item_runs)} {modality}(s) given")
            i += 1
        else:
            out.append(ids[i])
            i += 1
            continue
        runs.append((len(out), n))
        out.extend(run)
    if len(runs) != len(item_runs):
        raise ValueError(f"the prompt has {len(runs)} {modality} placeholder(s) for "
                         f"{len(item_runs)} {modality}(s): put one placeholder per {modality} "
                         "in the prompt (the chat template does it for image parts)")
    return out, runs


def _shift(features: list[MultiModalFeature], runs: list[tuple[int, int]]
           ) -> list[MultiModalFeature]:
    """Only one modality exists today; with several, earlier features' offsets would
    move by the growth of runs expanded before them. Refused until it is written."""
    if features and runs:
        raise ValueError("prompts mixing several modalities are not supported yet")
    return features
