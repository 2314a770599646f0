"""`pagoda scheduler --kv-advertise-host`: the addresses a prefill replica hands decode
replicas in `kv_transfer_params`. In a Kubernetes pod the gpu-worker is dialled on
loopback by its own scheduler (--worker-addr 127.0.0.1:PORT), which no other pod can
reach; the chart passes the pod's IP here so decode replicas pull from <pod IP>:PORT."""

from __future__ import annotations

from types import SimpleNamespace

from pagoda.kv_transfer.config import KVTransferConfig
from pagoda.kv_transfer.leases import Lease
from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as pb
from pagoda.services.cli.main import build_parser
from pagoda.services.scheduler.kv_role import build_hooks

PORT = 50052  # the port the scheduler bound


def _producer(*flags: str):
    args = build_parser().parse_args(["scheduler", "--host", "0.0.0.0",
                                      "--worker-addr", "127.0.0.1:50053", *flags])
    engine = SimpleNamespace(core=SimpleNamespace(scheduler=SimpleNamespace(
        kv_cache_manager=SimpleNamespace(pool=object())), kv_reset_listeners=[]))
    info = pb.GetModelInfoResponse(instance_id="prefill-0", epoch="e1", block_size=4)
    hooks = build_hooks(args, KVTransferConfig(kv_role="kv_producer"), engine, info,
                        kpb.KvLayout(epoch="w1"), PORT)
    return hooks.producer


def _params_of_a_finished_prompt(producer):
    """What the decode side receives for one prompt the producer finished and leased."""
    producer.table.pin = lambda request_id, hashes, tokens: Lease(
        "lease-1", request_id, [SimpleNamespace(block_id=7)], hashes[:1], 123.0)
    producer.expect(EngineCoreRequest("r1", list(range(8)), SamplingParams(max_tokens=1)))
    out = EngineCoreOutput("r1", [5], finish_reason=FinishReason.LENGTH)
    producer.on_outputs([out])
    return out.kv_transfer_params


def test_advertised_host_reaches_kv_transfer_params():
    params = _params_of_a_finished_prompt(_producer("--kv-advertise-host", "10.1.2.3"))
    assert params.remote_worker_address == "10.1.2.3:50053"
    assert params.remote_scheduler_address == f"10.1.2.3:{PORT}"
    assert (params.lease_id, params.remote_block_ids) == ("lease-1", [7])


def test_ipv6_pod_ip_is_bracketed():
    producer = _producer("--kv-advertise-host", "fd00::17")
    assert (producer.scheduler_address, producer.worker_address) == (
        f"[fd00::17]:{PORT}", "[fd00::17]:50053")


def test_without_the_flag_the_worker_address_is_as_given():
    """`pagoda serve` runs every process on one machine: loopback stays right there."""
    params = _params_of_a_finished_prompt(_producer())
    assert params.remote_worker_address == "127.0.0.1:50053"
    assert not params.remote_scheduler_address.startswith("0.0.0.0")
