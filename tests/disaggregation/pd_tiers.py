"""Shared pieces of the P/D + KV tier tests (test_pd_tiers*.py): the cluster's flags
(a 16-block device pool, an 8-slot host tier and a disk tier on each replica), the
prompts, their offline float32 answers, and requests through the gateway or straight
to a scheduler."""

from __future__ import annotations

import random

import grpc
import httpx
import openai
from pd_cluster import role_process
from prometheus_client.parser import text_string_to_metric_families
from serve_cluster import flag_value

from pagoda import LLM, SamplingParams
from pagoda.core.block_hash import DEFAULT_HASH_ALGO, hash_request_tokens
from pagoda.core.kv_disk_index import RECORD_OVERHEAD
from pagoda.core.kv_offload import GIB
from pagoda.kv_transfer.params import KVTransferParams
from pagoda.messages import EngineCoreRequest
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services.common.protocol.kv_transfer import kv_params_from_proto

BLOCK = 16
# The tiny model's whole KV block at 16 tokens: 3 layers x (k, v) x 16 x 2 heads x 16 x f32.
BLOCK_BYTES = 3 * 2 * BLOCK * 2 * 16 * 4
POOL_BLOCKS = 16
HOST_SLOTS = 8
MAX_TOKENS = 6
HITS = "pagoda_kv_offload_hits_total"
FAILED = "pagoda_kv_offload_failed_onloads_total"
MOVED = "pagoda_kv_transfer_blocks_total"


def tier_flags(disk_dir, disk_records: int = 128, host_slots: int = HOST_SLOTS) -> list[str]:
    return ["--num-gpu-blocks-override", str(POOL_BLOCKS), "--kv-offloading-backend", "native",
            "--kv-offloading-size", repr(host_slots * BLOCK_BYTES / GIB),
            "--kv-offloading-disk-path", str(disk_dir),
            "--kv-offloading-disk-size",
            repr(disk_records * (BLOCK_BYTES + RECORD_OVERHEAD) / GIB),
            "--kv-lease-timeout", "120"]


def prompt_sets(num_prefixes: int = 4, seed: int = 31
                ) -> tuple[list[list[int]], list[list[int]]]:
    """5-block prefixes (80 tokens), each with two suffixes (first visit, revisit)."""
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(3, 30000) for _ in range(5 * BLOCK - 1)]
                for _ in range(num_prefixes)]
    first = [p + [rng.randrange(3, 30000) for _ in range(7)] for p in prefixes]
    again = [p + [rng.randrange(3, 30000) for _ in range(9)] for p in prefixes]
    return first, again


def offline_answers(model_dir: str, prompts) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's greedy tokens from the offline float32 engine (a pool that never
    evicts)."""
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK, max_model_len=1024,
              num_gpu_blocks_override=512)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    return {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, out)}


def complete(serve, prompt: list[int]) -> list[int]:
    """The prompt's greedy tokens through the gateway."""
    client = openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=120)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                    temperature=0.0, logprobs=0,
                                    extra_body={"ignore_eos": True,
                                                "return_tokens_as_token_ids": True})
    return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


def request(request_id: str, prompt: list[int], params: KVTransferParams | None = None
            ) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(prompt),
                             SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                            ignore_eos=True),
                             kv_transfer_params=params)


def tokens(outputs) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def block_hashes(address: str, prompt: list[int]) -> list[bytes]:
    """The prompt's block hashes as the scheduler at `address` keys them."""
    with grpc.insecure_channel(address) as channel:
        info = spb_grpc.SchedulerServiceStub(channel).GetModelInfo(spb.GetModelInfoRequest(),
                                                                   timeout=10)
    return hash_request_tokens(prompt, BLOCK, info.prefix_hash_seed, (),
                               algo=info.prefix_caching_hash_algo or DEFAULT_HASH_ALGO)


def lease_prefix(address: str, prompt: list[int], num_blocks: int) -> KVTransferParams:
    """A lease on the prompt's first `num_blocks` blocks at the prefill scheduler (what
    the gateway's --kv-prefix-pull takes), ready for a decode request."""
    hashes = block_hashes(address, prompt)[:num_blocks]
    with grpc.insecure_channel(address) as channel:
        reply = kpb_grpc.KvLeaseServiceStub(channel).LeasePrefix(kpb.LeasePrefixRequest(
            request_id="lease-test", block_hashes=hashes,
            token_ids=prompt[:num_blocks * BLOCK], min_blocks=num_blocks), timeout=30)
    assert reply.HasField("kv_transfer_params"), "the prefill replica holds no such prefix"
    params = kv_params_from_proto(reply.kv_transfer_params)
    params.do_remote_prefill = True
    return params


def replica_metric(serve, role: str, name: str, **labels) -> float:
    """A sample of one replica's scheduler /metrics (kv_producer or kv_consumer), summed
    over the series whose labels include `labels`; 0 while it does not answer."""
    try:
        port = flag_value(role_process(serve, "scheduler", role).cmdline(), "--metrics-port")
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except (LookupError, httpx.HTTPError):
        return 0.0
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
