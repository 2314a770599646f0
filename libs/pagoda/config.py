"""Engine configuration: one dataclass per concern, resolved once at start-up.

The same values travel to every process of a replica (scheduler, workers,
tokenizer), so two processes never disagree on block size or hash seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.json_flag import json_object
from pagoda.lora.config import LoRAConfig
from pagoda.reasoning import get_reasoning_parser
from pagoda.reasoning.budget import ReasoningConfig
from pagoda.simulated_device import SimulatedDeviceConfig
from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.structured_output.backend import resolve_backend_name

# The prefix-cache hash seed. Every process of the cluster must use the same one,
# or the tokenizer's block hashes would not match the scheduler's and KV-aware
# routing would silently hit 0% (vLLM once seeded it randomly).
DEFAULT_PREFIX_HASH_SEED = "pagoda-prefix-cache-v1"
# vLLM's default --max-logprobs: the most top logprobs a request may ask for.
DEFAULT_MAX_LOGPROBS = 20


SLIDING_ATTENTION = "sliding_attention"  # HF `layer_types` value of a windowed layer
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class SlidingWindowConfig:
    """Sliding-window attention: a windowed layer attends to its last `window` tokens
    (itself included), as transformers' mask does.

    A shared feature, not a family's own setting: Mistral, Phi-3, Qwen2/3 and Gemma 2/3
    all window, and code outside the model reads it (the KV cache manager frees the
    blocks behind the window, `kv_cache_window`), so it must not live in any one
    family's settings. Invariant: `window` > 0; `layer_types` is None (every layer
    slides) or has one entry per layer, each `SLIDING_ATTENTION` or `FULL_ATTENTION`,
    at least one sliding (a config with none has no `SlidingWindowConfig`).
    """

    window: int
    layer_types: tuple[str, ...] | None = None

    def layer_window(self, layer_idx: int) -> int | None:
        """The window of layer `layer_idx`, or None when it attends to the whole context."""
        if self.layer_types is None or self.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.window
        return None


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP: a router picks `num_experts_per_tok` of
    `num_experts` experts per token.

    A shared feature, not a family's own setting: Mixtral and Qwen3-MoE both route, and
    the parallel set-up reads it (expert parallelism needs an expert per rank; experts
    split like a dense MLP otherwise). `intermediate_size` is each expert's (Mixtral:
    the model's `intermediate_size`); `norm_topk_prob` renormalises the top-k routing
    weights to sum to 1 (Mixtral always, Qwen-MoE per its config); the layers in
    `dense_mlp_layers` run a dense MLP of the model's `intermediate_size` instead.
    """

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    norm_topk_prob: bool = True
    dense_mlp_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba2 state-space layers of a hybrid model (GraniteMoeHybrid).

    `layers` are the indices of the layers whose mixer is a Mamba2 block (the others
    attend over the paged KV cache). Each such layer keeps, per running request, a
    conv state `[conv_dim, conv_kernel - 1]` (the last inputs of its causal conv) and
    an SSM state `[num_heads, head_dim, state_size]` (float32), carried across
    prefill chunks and decode steps (`pagoda.model.kv_cache.layer_cache_spec`).
    """

    layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclass
class ModelArchConfig:
    """Architecture of a decoder (or encoder), read from config.json (or a GGUF file).

    Only what every family has, plus the shared features that several families and
    code outside the model read: `sliding_window` (`SlidingWindowConfig`), `moe`
    (`MoEConfig`) and `kv_latent_dim` (the KV cache's layout), None when the model has none. What one family alone needs (Gemma's
    soft-capping, Phi-3's partial rotary, BERT's token types...) is that family's own
    settings dataclass, declared in its file under `pagoda.model.architectures`, parsed
    by its `ModelArchitecture.settings` and carried opaquely in `family_settings`
    (None when the family declares none or the source had no config.json: a GGUF file).
    Nothing outside the family's file reads `family_settings`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF `rope_scaling` / `rope_parameters` (type != default)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (and o_proj) biases; Qwen2 always has q/k/v ones
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    architecture: str = "LlamaForCausalLM"
    hidden_act: str = "silu"
    # The engine's context length, when known: longrope picks its long or short factors
    # by it once, for every position (vLLM's rule), so keys and queries always agree.
    max_model_len: int | None = None
    # config.json's `quantization_config` (or the one `--quantization` asks for),
    # resolved by `pagoda.model.quantization.resolve_quantization`; None: unquantized.
    quantization_config: dict | None = None
    # A sequence-classification head's outputs (any *ForSequenceClassification; the
    # shared pooler config names them); 0 for every other model.
    num_labels: int = 0
    sliding_window: SlidingWindowConfig | None = None
    moe: MoEConfig | None = None
    # Multi-head latent attention (DeepSeek-V2/V3): each layer caches one vector of this
    # width per token (compressed latent + shared rope key), no per-head keys and no
    # values (`pagoda.model.kv_cache.layer_cache_spec`); None: keys and values per KV head.
    kv_latent_dim: int | None = None
    # Hybrid models: the Mamba2 layers, which keep a fixed-size recurrent state per
    # request instead of KV blocks (`MambaConfig`); None: every layer attends.
    mamba: MambaConfig | None = None
    family_settings: object | None = None

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer `layer_idx`, or None when it attends to the whole context."""
        if self.sliding_window is None:
            return None
        return self.sliding_window.layer_window(layer_idx)

    @property
    def kv_cache_sliding_window(self) -> int | None:
        """The window when *every* layer slides, else None.

        Only then may the KV cache drop blocks that fall out of the window: a single
        full-attention layer (Gemma 2/3 alternate them) still reads every block.
        """
        windows = {self.layer_sliding_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 and None not in windows else None

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)


@dataclass
class CacheConfig:
    """Paged KV cache: fixed-size blocks, optional prefix caching."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    # Bytes of memory to give the KV cache when no override is set (CPU has no
    # "free device memory" to measure; GPU uses gpu_memory_utilization instead).
    kv_cache_memory_bytes: int = 2 * 1024**3
    gpu_memory_utilization: float = 0.9
    prefix_hash_seed: str = DEFAULT_PREFIX_HASH_SEED
    # --prefix-caching-hash-algo (pagoda.core.block_hash): the same in every service.
    prefix_caching_hash_algo: str = "pagoda"
    num_blocks: int = 0  # resolved at start-up
    # The model's window when every layer slides (`ModelArchConfig.kv_cache_sliding_window`):
    # blocks wholly before it are freed while a request runs. None keeps every block.
    sliding_window: int | None = None
    # vLLM's --kv-offloading-size (GiB) / --kv-offloading-backend: a host-memory tier
    # that keeps the KV of blocks evicted from the device pool (pagoda.core.kv_offload,
    # pagoda.worker.host_kv_tier). 0: off.
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "native"
    # A disk tier below the host tier (pagoda.worker.disk_kv_tier): blocks the host tier
    # evicts are written under this directory, at most this many GiB. None / 0: off.
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float = 0.0
    # A hybrid model with prefix caching: slots for recurrent-state checkpoints at block
    # boundaries (pagoda.core.state_checkpoints), beside the running requests' slots in
    # every Mamba layer's state pool. 0: none (no hybrid model, or no prefix caching).
    num_state_checkpoints: int = 0
    # How a prefix hit in those tiers is onloaded (--kv-offloading-onload): "async"
    # (default): the worker copies in the background while the request waits out of the
    # batch (WAITING_FOR_REMOTE_KVS), so the other requests keep stepping; "sync": the
    # copies run inside the step that admits it, before the forward (stalls the batch).
    kv_offloading_onload: str = "async"


@dataclass
class SchedulerConfig:
    """Batching limits of one step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Above this many prompt tokens a prefill is split so decodes keep flowing.
    long_prefill_token_threshold: int = 0
    max_waiting_requests: int | None = None
    # The waiting queue's order: "fcfs" or "priority" (`pagoda.core.request_queue`).
    policy: str = "fcfs"
    # --max-loras under --enable-lora: the running requests use at most this many
    # distinct adapters (each step's fit the worker's slots). None: LoRA off.
    max_loras: int | None = None
    # vLLM's --speculative-config: draft tokens verified each decode step (None: off).
    speculative_config: SpeculativeConfig | None = None
    # vLLM's --reasoning-config, resolved to token ids (None: off): requests'
    # thinking_token_budget is enforced (the worker forces the end marker; the
    # scheduler cuts drafts that would cross the budget).
    reasoning_config: ReasoningConfig | None = None
    # vLLM's --async-scheduling: step N+1 is planned while step N runs, each running
    # request assumed to get one more token (`Request.num_output_placeholders`).
    async_scheduling: bool = False
    # A multi-modal model's encoder budget (vLLM's names, in embedding rows): the rows of
    # media items that start encoding in one step (`pagoda.core.encoder_budget`), and
    # the rows the worker's encoder cache keeps. 0 for a text-only model.
    max_num_encoder_input_tokens: int = 0
    encoder_cache_size: int = 0


@dataclass
class MultiModalConfig:
    """A multi-modal model's input limits and preprocessing (vLLM's flags): at most
    `limit_mm_per_prompt[modality]` items per prompt (999 when a modality is left out),
    `mm_processor_kwargs` passed to the HF processor of every item (a request's own
    override them), and `mm_processor_cache_gb` GiB of processor outputs kept by content
    hash (0: off). Set only for a model whose architecture takes media."""

    limit_mm_per_prompt: dict = field(default_factory=dict)
    mm_processor_kwargs: dict = field(default_factory=dict)
    mm_processor_cache_gb: float = 4.0


@dataclass
class StructuredOutputsConfig:
    """vLLM's `--structured-outputs-config` (plus its `--reasoning-parser`).

    `backend`: the grammar engine: "xgrammar", "guidance" (llguidance) or "auto" (vLLM's
    default: xgrammar for each constraint it enforces, else guidance). `reasoning_parser`:
    the grammar applies only after this parser's reasoning-end token, unless
    `enable_in_reasoning`.
    """

    backend: str = "auto"
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    @classmethod
    def parse(cls, value: dict | str | None, reasoning_parser: str | None = None
              ) -> "StructuredOutputsConfig":
        """From the flag's JSON (or a dict); ValueError naming an unknown key, backend or
        reasoning parser."""
        value = json_object(value, "--structured-outputs-config") or {}
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--structured-outputs-config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if reasoning_parser:
            value["reasoning_parser"] = reasoning_parser
        config = cls(**value)
        resolve_backend_name(config.backend)
        if config.reasoning_parser:
            get_reasoning_parser(config.reasoning_parser)
        return config


# vLLM's pooling types this engine runs: the last token's hidden state (decoders),
# the mean over the prompt, or the first token's ([CLS] of an encoder).
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")  # ALL: every token (token_embed)


@dataclass
class PoolerConfig:
    """How a pooling model (`--runner pooling`) turns a prompt's last hidden states into
    one vector (vLLM's `PoolerConfig`), resolved once at start-up from the model folder
    (sentence-transformers' modules.json, 1_Pooling/config.json) and `--pooler-config`
    by `pagoda.model.pooler_config`.

    Invariant: `pooling_type` is one of POOLING_TYPES; `task` is "embed", "classify" or
    "token_embed" (a late-interaction model, ColBERT: one embedding per token, each of
    `hidden_size` values, scored by MaxSim; its pooling type is ALL);
    a classifier has one label name per output (`labels`), an embedding model none.
    """

    pooling_type: str = "LAST"
    normalize: bool = True  # embeddings are L2-normalised unless a request says otherwise
    task: str = "embed"  # the model's own task
    hidden_size: int = 0  # the embedding size (a request's `dimensions` may not exceed it)
    is_matryoshka: bool = False  # leading dimensions form usable smaller embeddings
    matryoshka_dimensions: tuple[int, ...] = ()  # the sizes it was trained for (empty: any)
    labels: tuple[str, ...] = ()  # a classifier's class names, in output order
    # Cohere's input_type -> the prefix put before each text (/v2/embed), in order.
    prompts: tuple[tuple[str, str], ...] = ()

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """Tasks a request may name: an embedding model embeds; a classifier classifies,
        and with one output also scores text pairs (a cross-encoder)."""
        if self.task in ("embed", "token_embed"):
            return (self.task,)
        tasks = ("classify", "score") if len(self.labels) == 1 else ("classify",)
        return tasks + ("token_classify",)  # the head on every token (`LLM.reward`)


@dataclass
class EngineConfig:
    """Everything one replica needs; built by `pagoda.engine.arg_utils.EngineArgs`."""

    model: str
    tokenizer: str | None
    dtype: str  # resolved: "float32" | "bfloat16" | "float16"
    arch: ModelArchConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    served_model_name: list[str] = field(default_factory=list)
    seed: int = 0
    device: str = "cpu"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "ray" | "mp" when the worker group has more than one rank; None for one rank.
    distributed_executor_backend: str | None = None
    enforce_eager: bool = False  # no CUDA graphs
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # -1: no limit
    # vLLM's --enable-expert-parallel: MoE experts placed whole on the TP ranks.
    enable_expert_parallel: bool = False
    # "auto" (the model dtype) or "fp8" (float8_e4m3fn, CUDA only).
    kv_cache_dtype: str = "auto"
    # vLLM's VLLM_BATCH_INVARIANT: greedy/seeded output independent of the batch,
    # chunking and prefix-cache hits (CPU: torch attention, `pagoda.model.attention`;
    # fixed-size linear products, `pagoda.model.batch_invariant_linear`).
    batch_invariant: bool = False
    # A GGUF 4-bit checkpoint on the CPU in bf16: small steps multiply from packed int4
    # (`pagoda.model.quantization.gguf_int4`); --gguf-int4 / --no-gguf-int4.
    gguf_int4: bool = False
    # vLLM's --runner, resolved: "generate" samples tokens; "pooling" returns one vector
    # per request (embeddings, classes, scores), as `pooler_config` says.
    runner: str = "generate"
    pooler_config: PoolerConfig | None = None
    # A bidirectional encoder (BERT): it keeps no KV cache, so nothing of a KV layout,
    # prefix caching, KV events or P/D transfers applies to it.
    is_encoder: bool = False
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # vLLM's --enable-lora with --max-loras/--max-lora-rank/--max-cpu-loras (None: no LoRA).
    lora: LoRAConfig | None = None
    # vLLM's logits_processors / --logits-processors: custom processor classes or their
    # fully qualified names, built in the worker (`pagoda.sample.logits_processor`).
    logits_processors: tuple = ()
    # vLLM's enable_sleep_mode: `sleep`/`wake_up` may free the weights and KV cache.
    enable_sleep_mode: bool = False
    # vLLM's weight_transfer_config ({"backend": "gloo" | "nccl"}; None: by device).
    weight_transfer_config: dict | None = None
    # --simulated-device (benchmarks): a device that sleeps each step and loads no
    # weights (pagoda.executor.simulated); None, the default: the real model runner.
    simulated_device: SimulatedDeviceConfig | None = None
    # Set for a model that takes images (pagoda.multimodal); None: text only.
    multimodal: MultiModalConfig | None = None

    @property
    def world_size(self) -> int:
        """Ranks in this replica's worker group."""
        return self.tensor_parallel_size * self.pipeline_parallel_size
