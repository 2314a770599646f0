"""LoRA adapters served by name: the registry and its flags (`--lora-modules`,
`registry.py`), and the runtime load/unload endpoints with the start-up check of the
listed adapters (`routes.py`). Where an adapter's requests go is
`routing/lora_placement.py`."""
