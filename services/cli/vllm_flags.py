"""vLLM flags Pagoda does not support, and the message a user of one gets.

A vLLM command line moved to Pagoda should fail with a sentence that names the flag
and says it is not supported, not argparse's usage dump. Flags Pagoda implements are
not listed here (tests/services/cli/test_vllm_flags.py checks that no entry is a real
Pagoda flag, so this list cannot go stale silently); anything else unknown gets the
generic message.
"""

from __future__ import annotations

# flag (without "--") -> why Pagoda has no such thing (shown after the flag's name).
UNSUPPORTED = {
    # models and weights
    "load-format": "Pagoda reads safetensors directories and GGUF files only",
    "code-revision": "Pagoda runs no remote code",
    "hf-token": "set the HF_TOKEN environment variable instead (a token on the command "
                "line is visible to every user of the machine)",
    "hf-overrides": "config overrides are not implemented",
    "hf-config-path": "the model folder's config.json is always used",
    "config-format": "the model folder's config.json is always used",
    "rope-scaling": "RoPE scaling comes from the model's config.json",
    "rope-theta": "RoPE theta comes from the model's config.json",
    "skip-tokenizer-init": "the tokenizer service is part of every cluster",
    "max-seq-len-to-capture": "CUDA graphs cover Pagoda's own decode batch sizes",
    "cuda-graph-sizes": "CUDA graphs cover Pagoda's own decode batch sizes",
    "compilation-config": "Pagoda does not use torch.compile",
    "calculate-kv-scales": "dynamic KV-cache scales are not implemented",
    "cpu-offload-gb": "weight offloading is not implemented",
    "weight-transfer-config": "weight transfer is offline only for now: "
                              "LLM(weight_transfer_config=...) with "
                              "init_weight_transfer_engine/update_weights",
    # adapters, multimodal, structured output, tools
    "guided-decoding-backend": "use --structured-outputs-config '{\"backend\": ...}' "
                               "(vLLM's newer flag)",
    "tool-parser-plugin": "parser plugins are not loaded; the built-in --tool-call-parser "
                          "names are hermes, llama3_json, mistral and pythonic",
    "chat-template-content-format": "the content format is detected from the template "
                                    "(text-only messages are flattened to strings)",
    "response-role": "the response role is always 'assistant'",
    # parallelism and platform
    "data-parallel-address": "data-parallel replicas of `pagoda serve` run on one machine "
                             "(use the Helm chart across machines)",
    "data-parallel-rpc-port": "data-parallel replicas of `pagoda serve` run on one machine",
    "data-parallel-size-local": "data-parallel replicas of `pagoda serve` run on one machine",
    "headless": "use the individual services (`pagoda scheduler`, `pagoda gpu-worker`, ...)",
    "disable-custom-all-reduce": "Pagoda uses torch.distributed's all-reduce only",
    "worker-cls": "the worker is Pagoda's own",
    "num-scheduler-steps": "multi-step scheduling is not implemented",
    # server
    "uds": "the gateway listens on TCP only",
    "middleware": "custom ASGI middleware is not loaded",
    "enable-ssl-refresh": "certificates are read once at start-up",
    "disable-fastapi-docs": "the gateway's FastAPI docs cannot be turned off yet",
    "return-tokens-as-token-ids": "ask per request with the `return_tokens_as_token_ids` field",
    "enable-log-outputs": "only inputs are logged (--enable-log-requests)",
    "lora-dtype": "adapters run in the model's dtype",
}


def unknown_flags_message(prog: str, flags: list[str]) -> str:
    """One line per unknown flag: vLLM's that Pagoda lacks say why; others say unknown."""
    lines = []
    for flag in dict.fromkeys(flags):  # once each, in order
        name = flag.split("=", 1)[0]
        reason = UNSUPPORTED.get(name.lstrip("-"))
        if reason is not None:
            lines.append(f"{name} (a vLLM flag) is not supported by Pagoda: {reason}.")
        else:
            lines.append(f"{name} is not supported by Pagoda: {prog} has no such flag "
                         f"(see `{prog} --help`).")
    return "\n".join(f"{prog}: error: {line}" for line in lines)


def unknown_key_message(path: str, key: str, prog: str) -> str:
    """For a config-file key that names no flag of `prog`."""
    name = str(key).replace("_", "-")
    reason = UNSUPPORTED.get(name)
    if reason is not None:
        return f"config file {path}: key {key!r} (vLLM's --{name}) is not supported by " \
               f"Pagoda: {reason}."
    return f"config file {path}: unknown key {key!r}: {prog} has no --{name} flag."
