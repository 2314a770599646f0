"""Tensor and pipeline parallelism: one model replica split across a group of ranks.

`parallel_state` says where a rank sits, `process_group` joins the group,
`communication` holds the collectives, `parallel_runner` runs a rank's share of a
step, and `rank_worker` is one rank (driver or follower). The driver's side of the
engine's `Executor` is `pagoda.executor.group`, which imports this package; this
package imports no executor. See README.md for the design.
"""
