"""Engine arguments with vLLM's names and CLI flags, resolved into an `EngineConfig`."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
from dataclasses import dataclass, fields

from pagoda.core.block_hash import DEFAULT_HASH_ALGO, check_hash_algo
from pagoda.config import (DEFAULT_MAX_LOGPROBS, DEFAULT_PREFIX_HASH_SEED, CacheConfig,
                           EngineConfig, SchedulerConfig, StructuredOutputsConfig)
import pagoda.envs as envs
from pagoda.distributed.parallel_state import validate_parallel_config
from pagoda.engine.async_steps import refuse_async_scheduling_combinations
from pagoda.engine.hybrid_limits import check_draft_model, check_hybrid_model
from pagoda.engine.multimodal_args import (add_multimodal_cli_args, encoder_budget,
                                           multimodal_config, refuse_multimodal_combinations)
from pagoda.engine.legacy_args import add_legacy_cli_args, resolve_legacy_args
from pagoda.lora.config import LoRAConfig
from pagoda.reasoning.budget import ReasoningConfig
from pagoda.simulated_device import FLAG_HELP as SIMULATED_DEVICE_HELP
from pagoda.simulated_device import SimulatedDeviceConfig
from pagoda.spec_decode.config import SpeculativeConfig, num_mtp_layers, refuse_mtp

# Why --trust-remote-code is refused rather than ignored: a user who passes it expects
# the model's own Python code to run, and Pagoda never runs it.
TRUST_REMOTE_CODE_REFUSED = (
    "--trust-remote-code is refused: Pagoda runs no remote code. It serves the model "
    "architectures it implements itself (see pagoda.model.registry); a model that needs "
    "its own Python code cannot be served.")

logger = logging.getLogger(__name__)


@dataclass
class EngineArgs:
    """What a user may set; `create_engine_config` turns it into resolved config."""

    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_waiting_requests: int | None = None
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: fcfs | priority
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # vLLM's KV offloading: a host-memory tier of this many GiB for evicted blocks
    # (None or 0: off) and its backend ("native" only).
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    # A disk tier below it (no vLLM flag; named after vLLM's, LMCache's local_disk /
    # max_local_disk_size): blocks the host tier evicts, under this directory, at most
    # this many GiB. Both or neither, and only with kv_offloading_size.
    kv_offloading_disk_path: str | None = None
    kv_offloading_disk_size: float | None = None
    # How a tier hit is onloaded: "async" (the default: in the background, the request
    # waits out of the batch) or "sync" (inside the step that admits it).
    kv_offloading_onload: str = "async"
    seed: int = 0
    served_model_name: list[str] | str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enforce_eager: bool = False
    prefix_cache_hash_seed: str = DEFAULT_PREFIX_HASH_SEED
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO
    device: str = "auto"
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    generation_config: str = "auto"
    override_generation_config: dict | str | None = None
    trust_remote_code: bool = False
    enable_sleep_mode: bool = False  # `sleep`/`wake_up` (LLM; served: /sleep, /wake_up)
    weight_transfer_config: dict | None = None  # {"backend": "gloo" | "nccl"}
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    enable_expert_parallel: bool = False
    batch_invariant: bool | None = None  # None: PAGODA_BATCH_INVARIANT / VLLM_BATCH_INVARIANT
    gguf_int4: bool | None = None  # None: on wherever it applies (`_resolve_gguf_int4`)
    # vLLM's --structured-outputs-config ({"backend": "auto" | "xgrammar", ...}) and
    # --reasoning-parser (the grammar starts after the reasoning ends).
    structured_outputs_config: dict | str | None = None
    reasoning_parser: str | None = None
    # vLLM's --reasoning-config JSON: the thinking markers thinking_token_budget uses.
    reasoning_config: dict | str | None = None
    # vLLM's --runner / --convert / --pooler-config (pagoda.model.pooler_config).
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict | str | None = None
    # vLLM's multi-LoRA flags (pagoda.lora.config.LoRAConfig).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's --speculative-config JSON (pagoda.spec_decode.config.SpeculativeConfig).
    speculative_config: dict | str | None = None
    # vLLM's logits_processors: classes or "pkg.module.Class" names (--logits-processors).
    logits_processors: list | None = None
    # vLLM flags kept for its command lines (pagoda.engine.legacy_args).
    task: str | None = None
    tokenizer_mode: str = "auto"
    swap_space: float | None = None
    # --simulated-device JSON (benchmarks only; pagoda.simulated_device). None: the model.
    simulated_device: dict | str | None = None
    # vLLM's --async-scheduling: plan step N+1 while step N runs (pagoda.engine.async_steps).
    # None: on where vLLM (>= 0.14) turns it on by default and Pagoda supports it (a CUDA
    # device, `async_scheduling_by_default`); True refuses what it cannot keep exact.
    async_scheduling: bool | None = None
    # vLLM's multi-modal settings (pagoda.engine.multimodal_args); used by models that
    # take images, ignored by text-only ones.
    limit_mm_per_prompt: dict | str | None = None
    mm_processor_kwargs: dict | str | None = None
    mm_processor_cache_gb: float = 4.0
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None

    def __post_init__(self) -> None:
        self.runner, self.convert = resolve_legacy_args(
            self.task, self.runner, self.convert, self.tokenizer_mode, self.swap_space)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, include_model: bool = True) -> argparse.ArgumentParser:
        d = EngineArgs
        if include_model:
            parser.add_argument("--model", default=None,
                                help="HF safetensors directory, GGUF file or Hugging Face model "
                                     "id ORG/NAME (default: SmolLM2-135M-Instruct).")
        add_hub_args(parser)
        parser.add_argument("--dtype", default=d.dtype,
                            choices=["auto", "float32", "float", "bfloat16", "float16", "half"])
        parser.add_argument("--max-model-len", type=int, default=None,
                            help="Context length (default: the model's).")
        parser.add_argument("--block-size", type=int, default=d.block_size)
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                            default=d.enable_prefix_caching)
        parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        parser.add_argument("--max-num-batched-tokens", type=int, default=None)
        parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                            default=d.enable_chunked_prefill)
        parser.add_argument("--long-prefill-token-threshold", type=int, default=0)
        parser.add_argument("--max-waiting-requests", type=int, default=None,
                            help="Bound of the scheduler's waiting queue; beyond it new requests "
                                 "are refused (HTTP 503 with Retry-After). Default: unbounded.")
        parser.add_argument("--scheduling-policy", default=d.scheduling_policy,
                            choices=["fcfs", "priority"],
                            help="fcfs: first come, first served; priority: requests with a "
                                 "lower `priority` value first (ties by arrival), and the "
                                 "highest value is preempted first.")
        parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
        parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                            default=None,
                            help="vLLM's async scheduling: the scheduler plans step N+1 while "
                                 "step N runs on the worker (each running request is assumed "
                                 "to get one more token; a request that finished at step N "
                                 "wastes one slot of step N+1, its extra token discarded), so "
                                 "the worker does not sit idle between steps. Greedy and "
                                 "seeded outputs are unchanged. Refused with speculative "
                                 "decoding, pipeline parallelism, pooling models and P/D KV "
                                 "transfer (kv_producer/kv_consumer). Default (as vLLM "
                                 ">= 0.14): on for a CUDA device where none of those applies, "
                                 "off on the CPU (where the worker's step is its own CPU "
                                 "time, so there is nothing to overlap); "
                                 "--no-async-scheduling turns it off.")
        parser.add_argument("--enable-sleep-mode", action="store_true",
                            help="vLLM's sleep mode: the engine may give back the memory of "
                                 "its weights and KV cache while idle (LLM.sleep/wake_up; "
                                 "`pagoda serve`: POST /sleep?level=1|2, POST /wake_up, "
                                 "GET /is_sleeping).")
        parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
        parser.add_argument("--kv-offloading-size", type=float, default=None,
                            help="GiB of host memory that keep the KV of blocks evicted from "
                                 "the device cache, onloaded on a later prefix hit "
                                 "(default: off).")
        parser.add_argument("--kv-offloading-backend", default=None, choices=["native"],
                            help="The KV offloading backend (native: Pagoda's host tier).")
        parser.add_argument("--kv-offloading-disk-path", default=None, metavar="DIR",
                            help="A directory for a disk KV tier below the host tier: "
                                 "blocks the host tier evicts are written there and "
                                 "onloaded on a later prefix hit. Its content from an "
                                 "earlier start is dropped. Needs --kv-offloading-size and "
                                 "--kv-offloading-disk-size (default: off).")
        parser.add_argument("--kv-offloading-disk-size", type=float, default=None,
                            metavar="GiB", help="GiB the disk KV tier may hold.")
        parser.add_argument("--kv-offloading-onload", default=d.kv_offloading_onload,
                            choices=["async", "sync"],
                            help="How a prefix found in the host or disk tier is copied back: "
                                 "async (default): in the background while the request waits "
                                 "out of the batch, so running requests keep decoding; sync: "
                                 "inside the step that admits it, before its forward.")
        parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        parser.add_argument("--seed", type=int, default=d.seed)
        parser.add_argument("--logits-processors", nargs="+", default=None, metavar="FQCN",
                            help="Custom logits processor classes (package.module.ClassName), "
                                 "vLLM's v1 LogitsProcessor interface.")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
        parser.add_argument("--distributed-executor-backend", default=None, choices=["ray", "mp"],
                            help="How the ranks of a tensor/pipeline-parallel group run: Ray "
                                 "actors in a placement group, or local processes (default: ray "
                                 "when installed and the group has more than one rank, else mp).")
        parser.add_argument("--enforce-eager", action="store_true")
        parser.add_argument("--prefix-cache-hash-seed", default=DEFAULT_PREFIX_HASH_SEED,
                            help="Seed of the prefix-cache block hashes; identical in every process "
                                 "(for vLLM's algorithms: the string vLLM reads from PYTHONHASHSEED).")
        parser.add_argument("--prefix-caching-hash-algo", default=DEFAULT_HASH_ALGO,
                            help="Block hash algorithm, identical in every process: pagoda "
                                 "(default), or vLLM's sha256 / sha256_cbor (sha256_cbor: what "
                                 "llm-d's kv-cache indexer computes).")
        parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
        parser.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                            help="Most logprobs (and prompt_logprobs) a request may ask for; "
                                 "-1: no limit.")
        parser.add_argument("--generation-config", default=d.generation_config,
                            help="Default sampling parameters: 'auto' (the model folder's "
                                 "generation_config.json), 'vllm' (none) or a folder.")
        parser.add_argument("--override-generation-config", default=None, metavar="JSON",
                            help='Laid over the generation config, e.g. \'{"temperature": 0.5}\'.')
        parser.add_argument("--quantization", "-q", default=None,
                            help="fp8, awq, gptq or compressed-tensors (default: what the "
                                 "checkpoint's config.json says). fp8 on an unquantized model "
                                 "quantizes its weights while loading.")
        parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                            choices=["auto", "fp8", "fp8_e4m3"],
                            help="auto: the model dtype; fp8: float8_e4m3fn keys and values "
                                 "(CUDA only).")
        parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                            default=None,
                            help="A request's greedy or seeded output independent of the rest "
                                 "of the batch, chunking and prefix-cache hits, at a cost in "
                                 "decode attention and small steps (default: $PAGODA_BATCH_INVARIANT or "
                                 "$VLLM_BATCH_INVARIANT, else off). CPU only.")
        parser.add_argument("--enable-expert-parallel", action="store_true",
                            help="Place mixture-of-experts experts whole on the tensor-parallel "
                                 "ranks instead of splitting each expert across them.")
        parser.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                            help='Structured outputs, e.g. \'{"backend": "xgrammar"}\' '
                                 '(backends: auto, xgrammar).')
        parser.add_argument("--reasoning-parser", default=None,
                            help="deepseek_r1, qwen3, granite, glm45, gpt_oss, kimi or mistral: a structured-output grammar applies "
                                 "after the reasoning ends (the gateway splits "
                                 "reasoning_content from content).")
        parser.add_argument("--reasoning-config", default=None, metavar="JSON",
                            help='The thinking markers, for requests\' thinking_token_budget, '
                                 'e.g. \'{"think_start_str": "<think>", "think_end_str": '
                                 '"</think>"}\' (or think_start_token_ids / think_end_token_ids).')
        parser.add_argument("--runner", default=d.runner, choices=["auto", "generate", "pooling"],
                            help="generate: text; pooling: embeddings, classification and "
                                 "scores (auto: pooling for encoders such as BertModel and "
                                 "sentence-transformers folders, else generate).")
        parser.add_argument("--convert", default=d.convert, choices=["auto", "embed"],
                            help="With --runner pooling: serve a generative decoder as an "
                                 "embedding model (last-token pooling).")
        parser.add_argument("--pooler-config", default=None, metavar="JSON",
                            help='The pooler of a pooling model, e.g. \'{"pooling_type": "MEAN", '
                                 '"normalize": false}\' (types: LAST, MEAN, CLS; default: the '
                                 "model's sentence-transformers config, else its architecture's).")
        parser.add_argument("--enable-lora", action="store_true",
                            help="Serve LoRA adapters (PEFT format) on top of the base model.")
        parser.add_argument("--max-loras", type=int, default=d.max_loras,
                            help="Adapters resident on the device at once (the distinct "
                                 "adapters one step may use).")
        parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                            help="The largest adapter rank accepted (sizes the device stacks).")
        parser.add_argument("--max-cpu-loras", type=int, default=None,
                            help="Adapters kept loaded in host memory (default: --max-loras).")
        parser.add_argument("--gguf-int4", action=argparse.BooleanOptionalAction, default=None,
                            help="Run a GGUF Q4_0/Q4_1 model's small CPU steps (up to 16 rows, "
                                 "e.g. decoding few requests) from its 4-bit weights (packed "
                                 "int4, a quarter of bf16's memory traffic); larger steps use "
                                 "bf16. Default: on for such models with --dtype bfloat16 on "
                                 "the CPU, unless --batch-invariant or --enable-lora.")
        parser.add_argument("--speculative-config", default=None, metavar="JSON",
                            help='Speculative decoding, e.g. \'{"method": "ngram", '
                                 '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                 '"prompt_lookup_min": 2}\' (n-gram prompt lookup; '
                                 '"disable_by_batch_size": N turns it off while N or more '
                                 "requests run).")
        parser.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction,
                            default=False, help="Refused: Pagoda runs no remote code.")
        parser.add_argument("--simulated-device", default=None, metavar="JSON",
                            help=SIMULATED_DEVICE_HELP)
        add_multimodal_cli_args(parser)
        add_legacy_cli_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def create_engine_config(self) -> EngineConfig:
        # lazy: torch and the model code load where an engine is built, not in the CLI, which
        # imports this module for its flags
        import torch

        if self.trust_remote_code:
            raise ValueError(TRUST_REMOTE_CODE_REFUSED)
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or non-negative, got "
                             f"{self.max_logprobs}")
        # lazy: torch and the model code load where an engine is built, not in the CLI, which
        # imports this module for its flags
        from pagoda.model.kv_cache import resolve_kv_cache_dtype
        from pagoda.model.loader import load_arch_config, resolve_dtype, resolve_model_path
        from pagoda.model.pooler_config import resolve_pooling
        from pagoda.model.quantization import resolve_quantization

        model_path = resolve_model_path(self.model, self.revision, self.download_dir)
        arch = load_arch_config(model_path)
        device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_dtype(self.dtype, device)
        arch = dataclasses.replace(arch, quantization_config=resolve_quantization(
            self.quantization, arch.quantization_config))
        if arch.quantization_config is not None:
            _refuse_unquantizable(arch)
            # lazy: torch and the model code load where an engine is built (see above)
            from pagoda.model.quantization import get_quantization_config

            method = get_quantization_config(arch.quantization_config)
            method.check_architecture(arch.architecture)
            if arch.moe is not None:
                from pagoda.model.moe_quantized import \
                    refuse_unsupported_expert_quantization  # lazy: as above

                refuse_unsupported_expert_quantization(method, arch.architecture)
        kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, device)
        pooling = resolve_pooling(model_path, arch, self.runner, self.convert, self.pooler_config)
        # A sentence-transformers model reads at most its max_seq_length tokens (vLLM's cap).
        max_model_len = self.max_model_len or min(arch.max_position_embeddings,
                                                  pooling.max_seq_length or 2**31)
        arch.max_model_len = max_model_len  # longrope picks its factors by it
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if self.async_scheduling is None:
            self.async_scheduling = async_scheduling_by_default(
                self, device, arch, pooling.runner)
        max_batched = self.max_num_batched_tokens or 2048
        # A pooling request runs its whole prompt in one step (an encoder attends over all
        # of it; mean pooling reads all of it): no chunked prefill for pooling models.
        chunked = self.enable_chunked_prefill and pooling.runner == "generate"
        if not chunked:
            max_batched = max(max_batched, max_model_len)
        _check_positive(block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                        max_num_batched_tokens=max_batched)
        if self.max_waiting_requests is not None:
            _check_positive(max_waiting_requests=self.max_waiting_requests)
        prefix_caching = check_hybrid_model(
            arch, tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size, enable_lora=self.enable_lora,
            kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=self.enable_prefix_caching,
            async_scheduling=self.async_scheduling)
        cache = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=prefix_caching and pooling.allows_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            gpu_memory_utilization=self.gpu_memory_utilization,
            prefix_hash_seed=self.prefix_cache_hash_seed,
            prefix_caching_hash_algo=check_hash_algo(self.prefix_caching_hash_algo),
            sliding_window=arch.kv_cache_sliding_window)
        if arch.mamba is not None and cache.enable_prefix_caching:
            cache.num_state_checkpoints = self.max_num_seqs  # one per running request
        if self.kv_cache_memory_bytes:
            cache.kv_cache_memory_bytes = self.kv_cache_memory_bytes
        cache.kv_offloading_size, cache.kv_offloading_backend = _kv_offloading(
            self.kv_offloading_size, self.kv_offloading_backend)
        cache.kv_offloading_disk_path, cache.kv_offloading_disk_size = _kv_offloading_disk(
            self.kv_offloading_disk_path, self.kv_offloading_disk_size, cache.kv_offloading_size)
        if self.kv_offloading_onload not in ("async", "sync"):
            raise ValueError(f"kv_offloading_onload must be 'async' or 'sync', got "
                             f"{self.kv_offloading_onload!r}")
        cache.kv_offloading_onload = self.kv_offloading_onload
        scheduler = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_batched,
            max_model_len=max_model_len, enable_chunked_prefill=chunked,
            long_prefill_token_threshold=(self.long_prefill_token_threshold
                                          if pooling.runner == "generate" else 0),
            max_waiting_requests=self.max_waiting_requests, policy=self.scheduling_policy,
            max_loras=self.max_loras if self.enable_lora else None,
            speculative_config=self._speculative_config(pooling.runner, arch, model_path),
            reasoning_config=self._reasoning_config(model_path, arch.vocab_size),
            async_scheduling=self.async_scheduling)
        refuse_async_scheduling_combinations(scheduler, self.pipeline_parallel_size,
                                             pooling.runner)
        if scheduler.speculative_config is not None and scheduler.speculative_config.uses_mtp:
            # lazy: as above
            from pagoda.model.registry import MODEL_REGISTRY

            arch = MODEL_REGISTRY.resolve(arch.architecture).enable_mtp(arch)
        refuse_multimodal_combinations(self, arch, pooling.runner)
        scheduler.max_num_encoder_input_tokens, scheduler.encoder_cache_size = encoder_budget(
            self, arch, max_batched, model_path)
        _refuse_offloading_combinations(cache, arch, self.async_scheduling)
        names = self.served_model_name
        if isinstance(names, str):
            names = [names]
        batch_invariant = self._resolve_batch_invariant(device)
        return EngineConfig(
            model=model_path, tokenizer=self._resolve_tokenizer(), dtype=str(dtype).removeprefix("torch."),
            arch=arch, cache=cache, scheduler=scheduler,
            served_model_name=list(names or [default_served_name(self.model, model_path)]),
            seed=self.seed, device=device, tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self._resolve_backend(arch),
            enforce_eager=self.enforce_eager, max_logprobs=self.max_logprobs,
            enable_expert_parallel=self.enable_expert_parallel, kv_cache_dtype=kv_cache_dtype,
            batch_invariant=batch_invariant,
            gguf_int4=self._resolve_gguf_int4(model_path, device, dtype, batch_invariant),
            structured_outputs=StructuredOutputsConfig.parse(self.structured_outputs_config,
                                                             self.reasoning_parser),
            runner=pooling.runner, pooler_config=pooling.pooler_config,
            is_encoder=pooling.is_encoder,
            lora=self._lora_config(),
            logits_processors=self._logits_processors(pooling.runner),
            enable_sleep_mode=self.enable_sleep_mode,
            weight_transfer_config=_weight_transfer_config(self.weight_transfer_config),
            simulated_device=SimulatedDeviceConfig.parse(self.simulated_device),
            multimodal=multimodal_config(self, arch))

    def _logits_processors(self, runner: str) -> tuple:
        # lazy: torch, loaded where an engine is built
        from pagoda.sample.logits_processor import resolve_logits_processor_classes

        if not self.logits_processors:
            return ()
        if runner != "generate":
            raise ValueError("Pooling models do not support custom logits processors.")
        if self.speculative_config:
            raise ValueError("logits_processors cannot be combined with speculative decoding "
                             "(a processor sees one row per request)")
        resolve_logits_processor_classes(self.logits_processors)  # fail here, not in a worker
        return tuple(self.logits_processors)

    def _resolve_batch_invariant(self, device: str) -> bool:
        on = envs.get("PAGODA_BATCH_INVARIANT") if self.batch_invariant is None \
            else self.batch_invariant
        if on and device != "cpu":
            raise ValueError("--batch-invariant (VLLM_BATCH_INVARIANT) is implemented for the "
                             "CPU attention path only; the CUDA kernels are not batch-invariant")
        return on

    def _resolve_gguf_int4(self, model_path: str, device: str, dtype, batch_invariant: bool
                           ) -> bool:
        # lazy: torch and the model code load where an engine is built, not in the CLI, which
        # imports this module for its flags
        from pagoda.model.loader import is_gguf
        from pagoda.model.quantization.gguf_int4 import resolve_gguf_int4

        return resolve_gguf_int4(self.gguf_int4, model_path if is_gguf(model_path) else None,
                                 device, dtype, batch_invariant, self.enable_lora)

    def _speculative_config(self, runner: str, arch, model_path: str):
        config = SpeculativeConfig.parse(self.speculative_config)
        if config is not None and config.uses_mtp:
            config = self._mtp_config(config, arch, model_path)
        if config is not None and runner != "generate":
            raise ValueError("--speculative-config applies to generation, not --runner pooling")
        if config is not None and self.pipeline_parallel_size > 1:
            raise ValueError("--speculative-config is not supported with pipeline parallelism")
        if config is not None and config.uses_mtp:
            return config
        if config is None or not config.uses_draft_model:
            return config
        # lazy: torch and the model code load where an engine is built, not in the CLI, which
        # imports this module for its flags
        from pagoda.model.loader import load_arch_config, resolve_model_path

        if self.tensor_parallel_size > 1:
            raise ValueError("--speculative-config: a draft model runs on a single-rank "
                             "worker (tensor_parallel_size 1)")
        if self.enable_lora:
            raise ValueError("--speculative-config: a draft model is not supported with "
                             "--enable-lora")
        path = resolve_model_path(config.model, None, self.download_dir)
        draft = load_arch_config(path)
        check_draft_model(draft)
        if draft.vocab_size != arch.vocab_size:
            raise ValueError(f"--speculative-config: the draft model {config.model!r} has a "
                             f"vocabulary of {draft.vocab_size} tokens, the target "
                             f"{arch.vocab_size}: a draft model must share the tokenizer")
        return dataclasses.replace(config, model=path, vocab_size=arch.vocab_size)

    def _mtp_config(self, config: SpeculativeConfig, arch, model_path: str) -> SpeculativeConfig:
        """`{"method": "mtp"}` checked against the checkpoint and the engine's features;
        num_speculative_tokens defaults to the checkpoint's MTP layers (vLLM's n_predict)."""
        # lazy: the model registry imports the architectures (torch) where an engine is built
        from pagoda.model.registry import MODEL_REGISTRY

        if not config.num_speculative_tokens:
            config = dataclasses.replace(config,
                                         num_speculative_tokens=max(num_mtp_layers(model_path), 1))
        refuse_mtp(config, arch.architecture, model_path,
                   MODEL_REGISTRY.resolve(arch.architecture).enable_mtp is not None,
                   **{"tensor parallelism (--tensor-parallel-size > 1)":
                      self.tensor_parallel_size > 1,
                      "pipeline parallelism (--pipeline-parallel-size > 1)":
                      self.pipeline_parallel_size > 1,
                      "--enable-expert-parallel": self.enable_expert_parallel,
                      "--enable-lora": self.enable_lora})
        return dataclasses.replace(config, vocab_size=arch.vocab_size)

    def _reasoning_config(self, model_path: str, vocab_size: int):
        """--reasoning-config with its markers as token ids (strings tokenized with the
        model's tokenizer, as vLLM does), else None."""
        config = ReasoningConfig.parse(self.reasoning_config)
        if config is None:
            return None
        tokenizer = None

        def tokenize(text: str) -> list[int]:
            nonlocal tokenizer
            if tokenizer is None:
                # lazy: transformers, loaded only when a marker is given as a string
                from pagoda.tokenizer.loader import load_tokenizer

                tokenizer = load_tokenizer(model_path, self._resolve_tokenizer())
            return tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))

        return config.resolve(tokenize, vocab_size)

    def _lora_config(self):
        """The LoRA settings under --enable-lora (validated), else None."""
        if not self.enable_lora:
            return None

        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _resolve_tokenizer(self) -> str | None:
        """A local path for `--tokenizer` (a hub id is fetched at --tokenizer-revision,
        else --revision, as vLLM does); None: the model's own."""
        if self.tokenizer is None:
            return None
        # lazy: the tokenizer loader brings transformers (and torch); the CLI imports this module
        # for its flags
        from pagoda.tokenizer.loader import resolve_tokenizer_path

        return resolve_tokenizer_path(self.tokenizer, self.tokenizer_revision or self.revision,
                                      self.download_dir)

    def _resolve_backend(self, arch) -> str | None:
        """Validate the parallel split against the model; pick the group's backend."""
        validate_parallel_config(arch, self.tensor_parallel_size, self.pipeline_parallel_size,
                                 self.enable_expert_parallel)
        if self.tensor_parallel_size * self.pipeline_parallel_size == 1:
            return None
        has_ray = importlib.util.find_spec("ray") is not None
        backend = self.distributed_executor_backend or ("ray" if has_ray else "mp")
        if backend not in ("ray", "mp"):
            raise ValueError(f"Unknown distributed_executor_backend {backend!r}; "
                             "expected 'ray' or 'mp'")
        if backend == "ray" and not has_ray:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install ray")
        return backend


def add_hub_args(parser) -> None:
    """--tokenizer and the Hugging Face hub flags, shared by every command that loads a
    model or tokenizer (the engine, the tokenizer service, `pagoda download`)."""
    parser.add_argument("--tokenizer", default=None,
                        help="Tokenizer directory, GGUF file or Hugging Face id (default: the "
                             "model's).")
    parser.add_argument("--revision", default=None,
                        help="Branch, tag or commit of a Hugging Face model id (default: main).")
    parser.add_argument("--tokenizer-revision", default=None,
                        help="Revision of a Hugging Face --tokenizer id (default: --revision).")
    parser.add_argument("--download-dir", default=None,
                        help="Cache folder for Hugging Face downloads (default: $HF_HUB_CACHE, "
                             "else $HF_HOME/hub). $HF_TOKEN authenticates; HF_HUB_OFFLINE=1 "
                             "reads the cache only.")


def default_served_name(model_arg: str | None, model_path: str) -> str:
    """The name clients use: the argument as given, or the default model's name."""
    if model_arg:
        return model_arg
    return "SmolLM2-135M-Instruct"


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def _weight_transfer_config(raw) -> dict | None:
    """vLLM's WeightTransferConfig as a dict (an object with `.backend` too)."""
    if raw is None:
        return None
    raw = raw if isinstance(raw, dict) else {"backend": getattr(raw, "backend", None)}
    backends = ("gloo", "nccl")
    if set(raw) != {"backend"} or raw["backend"] not in backends:
        raise ValueError(f"weight_transfer_config must be {{'backend': one of {backends}}}, "
                         f"got {raw!r}")
    return dict(raw)


def _refuse_unquantizable(arch) -> None:
    """ValueError when `arch`'s architecture runs no quantization method at all (its
    `ModelArchitecture.refuse_quantization` says why)."""
    from pagoda.model.registry import MODEL_REGISTRY  # lazy: as the model code above

    why = MODEL_REGISTRY.resolve(arch.architecture).refuse_quantization
    if why:
        method = arch.quantization_config.get("quant_method", "the requested")
        raise ValueError(f"{method} quantization of {arch.architecture} is not supported "
                         f"({why}): serve it without --quantization")


def _kv_offloading(size: float | None, backend: str | None) -> tuple[float, str]:
    """vLLM's --kv-offloading-size / --kv-offloading-backend -> (GiB, backend); a
    ValueError naming the flag for a negative size or another backend."""
    if size is not None and size < 0:
        raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {size}")
    if backend not in (None, "native"):
        raise ValueError(f"kv_offloading_backend {backend!r} is not supported; expected "
                         "'native' (LMCache is not built in)")
    return float(size or 0.0), backend or "native"


def _kv_offloading_disk(path: str | None, size: float | None,
                        host_size: float) -> tuple[str | None, float]:
    """--kv-offloading-disk-path / --kv-offloading-disk-size -> (directory, GiB); a
    ValueError naming the flag when one comes without the other, the size is not
    positive, or there is no host tier above the disk (its blocks come from there)."""
    if path is None and not size:
        return None, 0.0
    if not path:
        raise ValueError("kv_offloading_disk_size needs kv_offloading_disk_path (the "
                         "directory of the disk KV tier)")
    if size is None or size <= 0:
        raise ValueError(f"kv_offloading_disk_size must be > 0 GiB with "
                         f"kv_offloading_disk_path, got {size}")
    if host_size <= 0:
        raise ValueError("kv_offloading_disk_path needs kv_offloading_size > 0: the disk "
                         "tier keeps the blocks the host tier evicts")
    return str(path), float(size)


def async_scheduling_by_default(args: "EngineArgs", device: str, arch, runner: str) -> bool:
    """vLLM's default (>= 0.14): async scheduling on, except where it is not supported.
    Here: on for a CUDA device unless a feature it is refused with is set (speculative
    decoding, pipeline parallelism, pooling, the host KV tier, a hybrid Mamba2 or a
    multi-modal model), so the default never refuses a command line. Off on the CPU:
    the worker's step there is the same cores' time, with no device to keep busy.
    P/D roles turn it off in the scheduler service (`services/scheduler/server.py`)."""
    # lazy: the multi-modal registry imports model code
    from pagoda.multimodal.processing import is_multimodal_architecture

    return (device == "cuda" and not args.simulated_device
            and args.speculative_config is None and args.pipeline_parallel_size == 1
            and runner == "generate" and not args.kv_offloading_size
            and arch.mamba is None and not is_multimodal_architecture(arch.architecture))


def _refuse_offloading_combinations(cache: CacheConfig, arch, async_scheduling: bool) -> None:
    """ValueError naming a feature the host KV tier (--kv-offloading-size) cannot keep
    exact; a warning when the tier would hold nothing."""
    if not cache.kv_offloading_size:
        return
    if arch.mamba is not None:
        raise ValueError(f"--kv-offloading-size is not supported for {arch.architecture} "
                         "(hybrid Mamba2 model): the tier keeps attention blocks, and the "
                         "Mamba layers' state is not in them")
    if async_scheduling:
        raise ValueError("--kv-offloading-size is not supported with --async-scheduling: "
                         "the tier's copies are planned with each step, and steps sent ahead "
                         "are not verified with them")
    if not cache.enable_prefix_caching:
        logger.warning("--kv-offloading-size keeps evicted prefix-cache blocks; with prefix "
                       "caching off there are none, so the tier stays empty")
