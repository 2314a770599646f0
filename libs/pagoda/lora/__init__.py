"""Multi-LoRA: PEFT adapters applied per request on top of one base model (vLLM's `vllm.lora`)."""
