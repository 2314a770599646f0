"""Executors: what runs a step's plan on the workers, behind one interface.

`base` (the `Executor` interface and the group's errors), `in_process` (one rank,
the model runner in this process), `group` (rank 0 of a T x P worker group),
`multiproc` and `ray_group` (the group's two backends), and `factory`
(`make_executor`, which picks one for a config). Dependencies point one way:
factory -> concrete executors -> base; see README.md.
"""
