"""Model replicas of `pagoda serve`, with their KV roles.

`--data-parallel-size N`: N colocated replicas (each prefills and decodes its own
requests; `--kv-transfer-config` applies to all). `--prefill-replicas P
--decode-replicas D`: P kv_producer and D kv_consumer replicas behind one gateway;
each replica's role is on its scheduler's and gpu-worker's command line
(`--kv-transfer-config {...}`), so `ps` shows who does what.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pagoda.kv_transfer.config import (DEFAULT_KV_LEASE_TIMEOUT_S, DEFAULT_KV_TRANSFER_TIMEOUT_S,
                                       KV_CONNECTORS, KVTransferConfig)
from pagoda.services.common.kv_transfer_args import PD_NEEDS_PREFIX_CACHING
from pagoda.engine.async_steps import refuse_async_kv_transfer


@dataclass
class ReplicaPlan:
    scheduler: str  # service names
    worker: str
    index: int  # the replica number LocalCluster groups processes by
    kv_flags: list[str]  # --kv-transfer-config (and the pool's own TP) for both processes


def add_role_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefill/decode disaggregation")
    group.add_argument("--prefill-replicas", type=int, default=0,
                       help="Prefill-only (kv_producer) model replicas; with "
                            "--decode-replicas, instead of --data-parallel-size.")
    group.add_argument("--decode-replicas", type=int, default=0,
                       help="Decode (kv_consumer) model replicas: they pull each prompt's KV "
                            "blocks from the prefill replica that computed it.")
    for pool in ("prefill", "decode"):
        group.add_argument(f"--{pool}-tensor-parallel-size", type=int, default=None,
                           help=f"Tensor-parallel size of each {pool} replica (default: "
                                "--tensor-parallel-size). Blocks travel whole, so prefill and "
                                "decode replicas may be split differently.")
    group.add_argument("--kv-connector", default="PagodaConnector", choices=KV_CONNECTORS,
                       help="How the decode replicas' workers pull KV blocks: "
                            "PagodaConnector (gRPC streaming, checksummed) or "
                            "PagodaDistConnector (a torch.distributed pair group: NCCL on "
                            "CUDA, gloo on CPU).")
    group.add_argument("--kv-transfer-config", default=None,
                       help='vLLM\'s JSON for every colocated replica, e.g. {"kv_connector": '
                            '"PagodaConnector", "kv_role": "kv_both"}.')
    group.add_argument("--kv-lease-timeout", type=float, default=DEFAULT_KV_LEASE_TIMEOUT_S,
                       help="Seconds a prefill replica keeps blocks nobody pulled.")
    group.add_argument("--kv-transfer-timeout", type=float,
                       default=DEFAULT_KV_TRANSFER_TIMEOUT_S,
                       help="Seconds a decode replica waits for a pull before computing the "
                            "prompt itself.")


def role_problem(args: argparse.Namespace) -> str | None:
    p, d = args.prefill_replicas, args.decode_replicas
    if p < 0 or d < 0:
        return "--prefill-replicas and --decode-replicas cannot be negative"
    if (p > 0) != (d > 0):
        return "--prefill-replicas and --decode-replicas go together (at least 1 each)"
    if p and args.data_parallel_size != 1:
        return ("--data-parallel-size means colocated replicas; use --prefill-replicas and "
                "--decode-replicas for a disaggregated cluster, not both")
    pool_tp = (args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size)
    if not p and pool_tp != (None, None):
        return ("--prefill-tensor-parallel-size and --decode-tensor-parallel-size need "
                "--prefill-replicas and --decode-replicas")
    if any(tp is not None and tp < 1 for tp in pool_tp):
        return "--prefill-tensor-parallel-size and --decode-tensor-parallel-size must be >= 1"
    if not p and args.kv_connector != "PagodaConnector":
        return ("--kv-connector applies to --prefill-replicas/--decode-replicas (use "
                "--kv-transfer-config for colocated replicas)")
    if p and not getattr(args, "enable_prefix_caching", True):
        return f"--prefill-replicas/--decode-replicas: {PD_NEEDS_PREFIX_CACHING}"
    if p and args.kv_transfer_config:
        return "--kv-transfer-config is set per role by --prefill-replicas/--decode-replicas"
    try:
        KVTransferConfig.from_json(args.kv_transfer_config)
    except ValueError as exc:
        return str(exc)
    return None


def plan_replicas(args: argparse.Namespace) -> list[ReplicaPlan]:
    """SystemExit when --async-scheduling meets P/D roles (pagoda.engine.async_steps)."""
    if getattr(args, "async_scheduling", False):
        try:
            roles = (["kv_producer", "kv_consumer"] if args.prefill_replicas else
                     [KVTransferConfig.from_json(args.kv_transfer_config).kv_role])
            for role in roles:
                refuse_async_kv_transfer(True, role)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None

    def kv(role: str, tp: int | None = None) -> list[str]:
        config = KVTransferConfig(kv_connector=args.kv_connector, kv_role=role)
        flags = ["--kv-transfer-config", config.to_json()]
        # After the shared engine flags on the command line: the last value wins.
        return flags + (["--tensor-parallel-size", str(tp)] if tp is not None else [])

    if args.prefill_replicas:
        plans = [ReplicaPlan(f"scheduler-prefill-{i}", f"gpu-worker-prefill-{i}", i,
                             kv("kv_producer", args.prefill_tensor_parallel_size))
                 for i in range(args.prefill_replicas)]
        base = len(plans)
        plans += [ReplicaPlan(f"scheduler-decode-{i}", f"gpu-worker-decode-{i}", base + i,
                              kv("kv_consumer", args.decode_tensor_parallel_size))
                  for i in range(args.decode_replicas)]
        return plans
    n = args.data_parallel_size
    flags = ["--kv-transfer-config", args.kv_transfer_config] if args.kv_transfer_config else []
    return [ReplicaPlan("scheduler" if n == 1 else f"scheduler-{i}",
                        "gpu-worker" if n == 1 else f"gpu-worker-{i}", i, flags)
            for i in range(n)]


def scheduler_kv_flags(args: argparse.Namespace) -> list[str]:
    """The timeouts, when not the defaults (the scheduler's own defaults are equal)."""
    flags = []
    if args.kv_lease_timeout != DEFAULT_KV_LEASE_TIMEOUT_S:
        flags += ["--kv-lease-timeout", str(args.kv_lease_timeout)]
    if args.kv_transfer_timeout != DEFAULT_KV_TRANSFER_TIMEOUT_S:
        flags += ["--kv-transfer-timeout", str(args.kv_transfer_timeout)]
    return flags
