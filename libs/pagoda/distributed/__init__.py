"""Tensor and pipeline parallelism: the group's plumbing, below the worker.

`parallel_state` says where a rank sits, `process_group` joins the group,
`communication` holds the collectives and `wire_codec` types what travels on them.
The ranks themselves live in `pagoda.worker` (`rank_worker` is one rank, driver or
follower; `parallel_runner` runs a rank's share of a step); the driver's side of the
engine's `Executor` is `pagoda.executor.group`. This package imports neither: layers
point one way (worker and executor -> distributed). See README.md for the design.
"""
