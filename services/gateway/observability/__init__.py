"""What the gateway tells its operators: its Prometheus metrics and request spans
(`metrics.py`), vLLM's `http_*` series (`http_metrics.py`), and the routes monitors read,
`/health`, `/metrics` (the whole local cluster's with `--peer-metrics`) and `/version`
(`routes.py`), and the sum of the metrics over `--api-server-count` processes
(`multiprocess.py`)."""
