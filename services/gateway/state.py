"""What the gateway's routes share: peers, served names, API key, serving options."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from pagoda.lora.request import LoRARequest
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.lora.registry import LoRARegistry
from pagoda.services.gateway.routing.peers import Peers
from pagoda.services.gateway.serving_options import ServingOptions


@dataclass
class GatewayState:
    """Invariant: `served_model_names[0]` is the name responses report; `peers` is
    set when the app starts (inside its event loop)."""

    peers: Peers | None
    served_model_names: list[str] = field(default_factory=list)
    api_key: str | None = None
    options: ServingOptions = field(default_factory=ServingOptions)
    loras: LoRARegistry = field(default_factory=LoRARegistry)  # adapters served by name

    def fill_defaults(self, body, requested_max_tokens: int | None, prompts: list) -> int | None:
        """Lay the generation config's sampling defaults into `body`; the max_tokens to
        use (serving_options.py)."""
        info = self.peers.model_info()
        return self.options.fill_defaults(body, requested_max_tokens,
                                          [len(p.token_ids) for p in prompts], info.model,
                                          info.max_model_len)

    def check_model(self, model: str | None, allow_lora: bool = True) -> str:
        """The name to report (a base model's or a LoRA adapter's); 404 for a model
        this gateway does not serve, 400 for an adapter where `allow_lora` is False
        (the pooling endpoints: adapters apply to generation here)."""
        if model is not None and model in self.loras:
            if not allow_lora:
                raise APIError(f"The model `{model}` is a LoRA adapter; LoRA adapters are "
                               f"not supported by this endpoint.", 400, param="model")
            return model
        names = self.model_names()
        if model is None or model in names:
            return model or names[0]
        raise APIError(f"The model `{model}` does not exist.", 404, param="model")

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request for `model` runs with (None: the base model)."""
        return self.loras.get(model)

    def model_names(self) -> list[str]:
        """The configured names, else the ones the scheduler was started with."""
        if self.served_model_names:
            return self.served_model_names
        info = self.peers.model_info()
        return list(info.served_model_name) or [info.model]

    def is_authorized(self, authorization: str | None) -> bool:
        if not self.api_key:
            return True
        expected = f"Bearer {self.api_key}".encode()
        return hmac.compare_digest((authorization or "").encode(), expected)
