"""The disaggregation flags every model-replica service takes (scheduler, gpu-worker)
and `pagoda serve` passes on: vLLM's `--kv-transfer-config`, and the scheduler's
lease and transfer timeouts and the host it advertises to decode replicas."""

from __future__ import annotations

import argparse

from pagoda.kv_transfer.config import (DEFAULT_KV_LEASE_TIMEOUT_S, DEFAULT_KV_TRANSFER_TIMEOUT_S,
                                       KVTransferConfig)


# A prefill replica hands a prompt's blocks over by leasing them as cached blocks
# (scheduler/kv_producer.py pins them by block hash in the step that frees them) and the
# decode replica adopts them under the same hashes: without the prefix cache every lease
# would come back empty and each decode replica would prefill again, silently.
PD_NEEDS_PREFIX_CACHING = (
    "prefill/decode disaggregation needs the prefix cache: a prefill replica hands a "
    "prompt's KV blocks to the decode replica as cached blocks named by their block hashes, "
    "so with --no-enable-prefix-caching no block could be handed over and every request "
    "would be prefilled twice; drop --no-enable-prefix-caching")


def require_prefix_caching(role: KVTransferConfig, enable_prefix_caching: bool) -> None:
    """SystemExit for a kv_producer or kv_consumer replica without the prefix cache (a
    colocated kv_both replica only loses transfers it never needs)."""
    if role.kv_role in ("kv_producer", "kv_consumer") and not enable_prefix_caching:
        raise SystemExit(f"error: {PD_NEEDS_PREFIX_CACHING}")


def add_kv_transfer_args(parser: argparse.ArgumentParser, timeouts: bool = False) -> None:
    parser.add_argument(
        "--kv-transfer-config", default=None,
        help='vLLM\'s JSON: {"kv_connector": "PagodaConnector", "kv_role": '
             '"kv_producer|kv_consumer|kv_both"} (default kv_both: prefill and decode here).')
    if timeouts:
        parser.add_argument("--kv-lease-timeout", type=float, default=DEFAULT_KV_LEASE_TIMEOUT_S,
                            help="Seconds a prefill replica keeps a prompt's blocks for a decode "
                                 "replica to pull; unclaimed ones are freed after that.")
        parser.add_argument("--kv-transfer-timeout", type=float,
                            default=DEFAULT_KV_TRANSFER_TIMEOUT_S,
                            help="Seconds a decode replica waits for a pull; past that it "
                                 "computes the prompt itself.")
        parser.add_argument("--kv-advertise-host", default=None, metavar="HOST",
                            help="Host decode replicas dial for this prefill replica's lease "
                                 "service (on --port) and its gpu-worker's KV blocks (on "
                                 "--worker-addr's port), e.g. a pod's IP when --worker-addr "
                                 "is loopback and the gpu-worker listens on every interface. "
                                 "Default: --host (a wildcard as this machine's IP) and "
                                 "--worker-addr as given.")


def kv_transfer_config(args: argparse.Namespace) -> KVTransferConfig:
    """The parsed flag; SystemExit naming the problem if it is invalid."""
    try:
        return KVTransferConfig.from_json(getattr(args, "kv_transfer_config", None))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
