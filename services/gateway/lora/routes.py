"""vLLM's runtime adapter endpoints, and the start-up check of `--lora-modules`.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Served only with `--allow-runtime-lora-updating` or VLLM_ALLOW_RUNTIME_LORA_UPDATING
(otherwise the routes do not exist: 404, as in vLLM), behind the API key like every
/v1 route. Answers as vLLM's: 200 with a plain-text "Success: ..." line; 400 for a
missing field, a name already loaded (unless `load_inplace`) or an adapter a replica
cannot run; 404 for an adapter directory that is not there or an unknown name.

Loading asks every routable replica to check the adapter (`CheckLoRAAdapter`: LoRA
enabled, a PEFT LoRA config within --max-lora-rank, a weights file) before the name
is served, since routing may send its requests to any of them; the weights are read
by a replica when its first request with the adapter arrives. The registry is this
gateway's: with several gateways, load an adapter through each (as with vLLM's API
servers), or list it in --lora-modules.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pagoda.lora.request import LoRARequest
from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.state import GatewayState

logger = logging.getLogger(__name__)
router = APIRouter()
CHECK_TIMEOUT_S = 30.0


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM ignores what it does not know
    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str | None = None
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    name, path = body.lora_name, body.lora_path
    if not name or not path:
        raise APIError("Both 'lora_name' and 'lora_path' must be provided.", 400,
                       err_type="InvalidUserInput")
    if name in state.loras and not body.load_inplace:
        raise APIError(f"The lora adapter '{name}' has already been loaded. If you want to "
                       f"load the adapter in place, set 'load_inplace' to True.", 400,
                       err_type="InvalidUserInput")
    if name in state.model_names():
        raise APIError(f"The name '{name}' is the base model's.", 400, param="lora_name")
    lora = LoRARequest(name, 1, path)  # the id is the registry's; the check reads the path
    await check_on_replicas(state, lora)
    state.loras.add(name, path)
    logger.info("LoRA adapter %s loaded from %s", name, path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    state: GatewayState = request.app.state.gateway
    name = body.lora_name
    if not name:
        raise APIError("'lora_name' needs to be provided to unload a LoRA adapter.", 400,
                       err_type="InvalidUserInput")
    if not state.loras.remove(name):
        raise APIError(f"The lora adapter '{name}' cannot be found.", 404,
                       err_type="NotFoundError")
    logger.info("LoRA adapter %s unloaded", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def check_on_replicas(state: GatewayState, lora: LoRARequest) -> None:
    """Every routable replica can run `lora`, or an APIError saying why one cannot."""
    replicas = [r for r in state.peers.schedulers if r.is_routable()]
    if not replicas:
        raise APIError("No scheduler replica is available.", 503)
    message = cpb.LoRARequest(lora_name=lora.lora_name, lora_int_id=lora.lora_int_id,
                              lora_path=lora.lora_path)
    results = await asyncio.gather(*(r.stub.CheckLoRAAdapter(message, timeout=CHECK_TIMEOUT_S)
                                     for r in replicas), return_exceptions=True)
    for replica, result in zip(replicas, results):
        if isinstance(result, grpc.RpcError):
            if result.code() == grpc.StatusCode.INVALID_ARGUMENT:
                details = result.details() or "the adapter cannot run"
                status = 404 if "No adapter_config.json" in details else 400
                raise APIError(f"Loading LoRA adapter '{lora.lora_name}' failed: {details}",
                               status)
            logger.warning("CheckLoRAAdapter on %s: %s %s", replica.address,
                           result.code().name, result.details())
            raise APIError("A model replica could not check the adapter; retry later.", 503)
        if isinstance(result, BaseException):
            raise result


async def check_static_adapters(state: GatewayState, on_fatal, poll_s: float = 1.0) -> None:
    """Once a replica is routable, check every --lora-modules adapter on the replicas;
    one that cannot run is fatal (the gateway exits naming it, as vLLM fails at
    start-up) rather than a 400 on every request for it."""
    if not len(state.loras):
        return
    while not any(r.is_routable() for r in state.peers.schedulers):
        await asyncio.sleep(poll_s)
    for lora, _ in state.loras.items():
        while True:
            try:
                await check_on_replicas(state, lora)
                break
            except APIError as exc:
                if exc.status == 503:  # a replica went away or was slow: ask again
                    await asyncio.sleep(poll_s)
                    continue
                message = f"--lora-modules {lora.lora_name}={lora.lora_path}: {exc.message}"
                if on_fatal is not None:
                    on_fatal(message)
                else:
                    logger.critical("%s", message)
                return
