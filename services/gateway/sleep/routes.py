"""vLLM's sleep mode endpoints, sent on to every model replica.

    POST /sleep?level=1        (level 1: weights offloaded, 2: discarded; default 1)
    POST /wake_up[?tags=weights&tags=kv_cache]   (default: both)
    GET  /is_sleeping          -> {"is_sleeping": bool}

Served only with `--enable-sleep-mode` (vLLM serves them only in its dev mode with
the flag): otherwise the paths do not exist, 404. Behind the API key like every
route but the health probes. Answers as vLLM's: 200 with an empty body.

Every replica the gateway knows sleeps or none does: when one refuses -- requests in
flight (409 naming how many), already asleep (409), a bad level or tag (400) -- or
cannot be reached (503), those that had gone to sleep for this call are woken again
and the refusal is answered. (A replica that restarts comes back awake.)
While asleep, generation requests get 503 "The model is sleeping ..."
(errors.from_grpc_error), never a hang. After level 2, a replica reloads its weights
from its checkpoint on wake_up (services/scheduler/sleep_control.py), so the model
serves as before.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.state import GatewayState

logger = logging.getLogger(__name__)
router = APIRouter()
# Offloading or reloading a large model's weights takes a while (a step's order).
CALL_TIMEOUT_S = 600.0
_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 409}


@router.post("/sleep")
async def sleep(request: Request, level: str = Query("1")):
    try:
        value = int(level)
    except ValueError:
        value = 0
    if value not in (1, 2):
        raise APIError(f"level must be 1 or 2, got {level!r}", 400, param="level")
    replicas = _replicas(request)
    slept, failure = await _on_all(replicas, "SleepEngine", spb.SleepEngineRequest(level=value))
    if failure is not None:
        if slept:  # all or none: the others go back to what they were
            await _on_all(slept, "WakeUpEngine", spb.WakeUpEngineRequest())
        raise failure
    logger.info("%d replica(s) sleep (level %d)", len(replicas), value)
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)):
    replicas = _replicas(request)
    _, failure = await _on_all(replicas, "WakeUpEngine", spb.WakeUpEngineRequest(tags=tags or []))
    if failure is not None:
        raise failure
    logger.info("%d replica(s) woke up (%s)", len(replicas), ", ".join(tags or ["all"]))
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    """True when any replica has something asleep."""
    replicas = _replicas(request)
    states, failure = await _on_all(replicas, "GetSleepState", spb.GetSleepStateRequest(),
                                    results=True)
    if failure is not None:
        raise failure
    return JSONResponse({"is_sleeping": any(s.is_sleeping for s in states)})


def _replicas(request: Request) -> list:
    state: GatewayState = request.app.state.gateway
    # Every one, routable or not yet: a replica left awake would serve while the rest
    # sleep (one that cannot be reached fails the call, 503).
    replicas = [r for r in state.peers.schedulers if not r.removed]
    if not replicas:
        raise APIError("No model replica is available.", 503)
    return replicas


async def _on_all(replicas: list, method: str, message, results: bool = False
                  ) -> tuple[list, APIError | None]:
    """Call `method` on every replica at once: (the replicas that succeeded, or their
    answers with `results`; the first failure as the client should see it, or None)."""
    answers = await asyncio.gather(*(getattr(r.stub, method)(message, timeout=CALL_TIMEOUT_S)
                                     for r in replicas), return_exceptions=True)
    done, failure = [], None
    for replica, answer in zip(replicas, answers):
        if isinstance(answer, grpc.RpcError):
            logger.warning("%s on %s: %s %s", method, replica.address, answer.code().name,
                           answer.details())
            if failure is None:
                failure = _as_api_error(answer, len(replicas))
        elif isinstance(answer, BaseException):
            raise answer
        else:
            done.append(answer if results else replica)
    return done, failure


def _as_api_error(exc: grpc.RpcError, num_replicas: int) -> APIError:
    status = _STATUS.get(exc.code(), 503)
    if status == 503:
        return APIError("A model replica could not be reached; retry later.", 503)
    prefix = "A model replica refused: " if num_replicas > 1 else ""
    return APIError(f"{prefix}{exc.details()}", status)
