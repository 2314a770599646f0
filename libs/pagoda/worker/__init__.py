"""The worker side of a step: persistent batch, model runner, attention inputs, and
a rank of a tensor/pipeline group (`rank_worker`, `parallel_runner`) over the
plumbing of `pagoda.distributed`."""
