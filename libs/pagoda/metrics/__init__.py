"""Engine metrics with vLLM's names, and the periodic stats log line.

`stats` turns what the engine core reports each step into per-iteration and
per-request statistics (plain Python, no Prometheus); `engine_metrics` records
them as Prometheus metrics named exactly as vLLM names them; `stat_logger`
prints vLLM's "Avg prompt throughput ..." line every `--log-stats-interval`
seconds; `aggregate` merges several processes' `/metrics` into one exposition.
Importing this package imports nothing heavy.
"""
