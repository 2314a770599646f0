"""What an architecture file declares: `ModelArchitecture` (one per HF class name),
`GGUFLayout` (llama.cpp's tensor names for it) and, when the family has settings of its
own, a `FamilySettings` dataclass that its layers read back with `family_settings`.

Kept apart from `registry` so dependencies point one way: architecture files import
this module, the registry imports this module and (lazily) the architecture files.
Importing it costs nothing: no torch, no gguf.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from pagoda.config import ModelArchConfig

SettingsT = TypeVar("SettingsT")


class FamilySettings(Protocol):
    """A family's own settings: a frozen dataclass in its architecture file, every field
    defaulted (a GGUF file or a config built in code carries none: the defaults apply).
    It travels in `ModelArchConfig.family_settings`, pickled with the config to every
    rank, so it holds plain values only."""

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> FamilySettings:
        """Parse config.json (`arch`: the common fields, after `update_arch_config`)."""
        ...


def family_settings(arch: ModelArchConfig, settings_cls: type[SettingsT]) -> SettingsT:
    """The family settings `arch` carries, or `settings_cls()` when it carries none.

    TypeError when it carries another family's (a subclass counts: Gemma 3's settings
    extend Gemma 2's, whose layers it reuses).
    """
    settings = arch.family_settings
    if settings is None:
        return settings_cls()
    if not isinstance(settings, settings_cls):
        raise TypeError(f"{arch.architecture} carries {type(settings).__name__}, "
                        f"not {settings_cls.__name__}")
    return settings


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp names and stores one architecture's tensors.

    `global_tensors` maps a GGUF base name to an HF prefix (`token_embd` ->
    `model.embed_tokens`); `layer_tensors` maps the part after `blk.N.` to the part
    after `model.layers.N.` (`attn_q` -> `self_attn.q_proj`). `rotary_rows_permuted`:
    llama.cpp's converter permuted the rows of Q and K (its "llama" architecture does,
    "qwen2" does not), so the loader undoes it.
    """

    global_tensors: Mapping[str, str]
    layer_tensors: Mapping[str, str]
    rotary_rows_permuted: bool = False

    def hf_tensor_name(self, gguf_name: str) -> str:
        """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, etc."""
        base, suffix = gguf_name.rsplit(".", 1)
        if base in self.global_tensors:
            return f"{self.global_tensors[base]}.{suffix}"
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in self.layer_tensors:
            return f"model.layers.{parts[1]}.{self.layer_tensors[parts[2]]}.{suffix}"
        raise ValueError(f"Unknown GGUF tensor {gguf_name!r}")


# (config.json as a dict, the config parsed the common way) -> the config to run with.
ConfigHook = Callable[[dict, "ModelArchConfig"], "ModelArchConfig"]


@dataclass(frozen=True)
class ModelArchitecture:
    """How Pagoda runs one HF architecture class name (config.json `architectures`).

    `model_cls(arch, dtype, parallel)` builds one rank's share of the model; it has
    `forward`, `compute_logits`, `load_weights(HF-named tensors)` (its class attribute
    `packed_modules_mapping` says which HF tensors it fuses) and
    `needs_checkpoint_tensor`. `update_arch_config` adjusts the common fields the
    config.json parser read (one the HF config leaves implicit, say); `settings` (a
    `FamilySettings` class) then parses the family's own settings into
    `ModelArchConfig.family_settings`. GGUF files carry no config.json and skip both.
    `gguf_layouts` maps each GGUF
    `general.architecture` this class runs to that format's tensor names.
    `text_config_key` names the nested language-model config of a multi-modal model
    (LLaVA's `text_config`): the common fields are parsed from it, the family settings
    from the whole config.json. `refuse_quantization`, when set, is why no quantization method (a quantized
    checkpoint, or `--quantization`) can run this architecture: refused when the engine
    config is built, before any method-specific rule. `enable_mtp`, when set, turns a
    config into one whose model also holds its MTP draft layer (DeepSeek-V3).
    Invariant: `hf_name` is the registry key; several entries may share a `model_cls`.
    """

    hf_name: str
    model_cls: type
    update_arch_config: ConfigHook | None = None
    settings: type[FamilySettings] | None = None
    gguf_layouts: Mapping[str, GGUFLayout] = field(default_factory=dict)
    refuse_quantization: str | None = None
    text_config_key: str | None = None
    # The config that also builds the checkpoint's multi-token-prediction layer as a
    # draft head (`{"method": "mtp"}`); None: the architecture has no MTP drafts.
    enable_mtp: Callable[["ModelArchConfig"], "ModelArchConfig"] | None = None

    @property
    def family(self) -> str:
        """`MistralForCausalLM` -> "mistral": how GGUF `general.name` spells the family."""
        return self.hf_name.removesuffix("ForCausalLM").lower()
