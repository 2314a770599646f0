"""`LLM`'s control methods with vLLM's names: sleep mode, `collective_rpc`,
`apply_model`, and weight transfer for RL loops (`init_weight_transfer_engine`,
`update_weights`). The work is `pagoda.engine.worker_control`'s and, on each rank,
`pagoda.worker.worker_ops`'."""

from __future__ import annotations

import threading
from typing import Any, Callable

from pagoda.engine import worker_control


class ControlMethods:
    """Mixed into `LLM`: needs `self.llm_engine`."""

    # ------------------------------------------------------------ sleep mode
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache and offload (level 1) or discard (level 2) the weights.
        Needs `enable_sleep_mode=True` and an idle engine; the prefix cache is dropped."""
        worker_control.sleep(self.llm_engine.core, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of `tags` ("weights", "kv_cache"; default both)."""
        worker_control.wake_up(self.llm_engine.core, tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.core.sleep.is_sleeping

    # ------------------------------------------------------------ worker calls
    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run `method` on every rank of the worker group and return the results in rank
        order: a worker method's name (`pagoda.worker.worker_ops.RPC_METHODS`) or a
        callable given the worker (`worker.get_model()`, `worker.model_runner`,
        `worker.rank`). On a group of several ranks, arguments must be JSON values and a
        callable a module-level function. `timeout`: TimeoutError when the call takes
        longer (it still finishes on the ranks; the engine is busy until then)."""
        core = self.llm_engine.core
        if timeout is None:
            return worker_control.collective_rpc(core, method, args, kwargs)
        outcome: dict[str, Any] = {}

        def call() -> None:
            try:
                outcome["ok"] = worker_control.collective_rpc(core, method, args, kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                outcome["error"] = exc

        thread = threading.Thread(target=call, name="collective-rpc", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"collective_rpc({method!r}) did not finish within {timeout} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["ok"]

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """`func(model)` on every rank's model (its share of the weights); the results
        in rank order."""
        if self.llm_engine.config.world_size == 1:
            return self.collective_rpc(lambda worker: func(worker.get_model()))
        from pagoda.worker.worker_ops import callable_name  # lazy: torch-side module

        return self.collective_rpc("apply_model", args=(callable_name(func),))

    # ------------------------------------------------------------ weight transfer
    def init_weight_transfer_engine(self, request: Any) -> None:
        """Join the trainer's weight-transfer group: `request` is vLLM's
        WeightTransferInitRequest or a dict {"init_info": {master_address, master_port,
        rank_offset, world_size}} (pagoda.distributed.weight_transfer)."""
        init_info = _field(request, "init_info")
        backend = (self.llm_engine.config.weight_transfer_config or {}).get("backend")
        self.collective_rpc("init_weight_transfer_engine", args=(init_info, backend))

    def update_weights(self, request: Any) -> None:
        """Receive one round of weights from the trainer and load them in place:
        `request` is vLLM's WeightTransferUpdateRequest or a dict {"update_info":
        {names, dtype_names, shapes}}. Needs an idle engine; drops the prefix cache."""
        self.collective_rpc("update_weights", args=(_field(request, "update_info"),))


def _field(request: Any, name: str) -> Any:
    value = request.get(name) if isinstance(request, dict) else getattr(request, name, None)
    if value is None:
        raise ValueError(f"The request has no {name!r}")
    return value
