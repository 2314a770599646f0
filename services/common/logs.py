"""Service logging: one line per record, to stderr, tagged with the service name."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(service: str) -> None:
    """Configure the root logger once per process (`PAGODA_LOG_LEVEL`, default INFO)."""
    level = os.environ.get("PAGODA_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        stream=sys.stderr,
        level=level,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
        force=True,
    )
