"""The parallelism flags reach every command that builds an engine config."""

from __future__ import annotations

import pytest

from pagoda.services.cli.main import build_parser
from pagoda.services.cli.serve import engine_flags

FLAGS = ["-tp", "2", "--pipeline-parallel-size", "2", "--distributed-executor-backend", "mp"]


@pytest.mark.parametrize("command", ["scheduler", "gpu-worker"])
def test_services_accept_the_flags(command):
    args = build_parser().parse_args([command, *FLAGS])
    assert (args.tensor_parallel_size, args.pipeline_parallel_size,
            args.distributed_executor_backend) == (2, 2, "mp")


def test_serve_passes_the_flags_to_scheduler_and_worker():
    args = build_parser().parse_args(["serve", "some-model", *FLAGS])
    flags = engine_flags(args)
    assert flags[flags.index("--tensor-parallel-size") + 1] == "2"
    assert flags[flags.index("--pipeline-parallel-size") + 1] == "2"
    assert flags[flags.index("--distributed-executor-backend") + 1] == "mp"


def test_unknown_backend_is_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gpu-worker", "--distributed-executor-backend", "dask"])
