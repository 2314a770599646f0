"""Service logging: one line per record, to stderr, tagged with the service name.

What the environment may change (vLLM's variables and behaviour, `pagoda.envs`):
  * PAGODA_LOG_LEVEL / VLLM_LOGGING_LEVEL: the root level (default INFO);
  * PAGODA_CONFIGURE_LOGGING / VLLM_CONFIGURE_LOGGING=0: configure nothing (the
    embedding application owns logging);
  * PAGODA_LOGGING_CONFIG_PATH / VLLM_LOGGING_CONFIG_PATH: a JSON
    `logging.config.dictConfig` used instead of Pagoda's format. Asking for a config
    file while configuration is off is an error, as in vLLM: one of the two is a mistake.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import sys

import pagoda.envs as envs


def setup_logging(service: str) -> None:
    """Configure the root logger once per process, as the environment says."""
    config_path = envs.get("PAGODA_LOGGING_CONFIG_PATH")
    if not envs.get("PAGODA_CONFIGURE_LOGGING"):
        if config_path:
            raise RuntimeError(
                f"{envs.source('PAGODA_CONFIGURE_LOGGING')} turns logging configuration off, "
                f"but {envs.source('PAGODA_LOGGING_CONFIG_PATH')}={config_path} asks for a "
                f"logging config: unset one of them.")
        return
    if config_path:
        logging.config.dictConfig(_load_dict_config(config_path))
        return
    logging.basicConfig(
        stream=sys.stderr,
        level=envs.get("PAGODA_LOG_LEVEL"),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
        force=True,
    )


def _load_dict_config(path: str) -> dict:
    if not os.path.exists(path):
        raise RuntimeError(f"Could not load logging config: file {path} does not exist.")
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as exc:
            raise RuntimeError(f"Logging config {path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise RuntimeError(f"Logging config {path} must be a JSON object (a dictConfig), "
                           f"got {type(config).__name__}.")
    return config
