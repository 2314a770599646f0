"""vLLM's OpenAI-server flags for the gateway: what they change, and their CLI.

`ServingOptions` (in `GatewayState.options`) is what the routes consult:
  * `--max-logprobs` (default 20, -1: no limit): a request asking for more top
    logprobs or prompt logprobs gets a 400 naming the limit;
  * `--generation-config auto|vllm|FOLDER`, `--override-generation-config JSON`: the
    model's recommended sampling settings fill the fields a request leaves unset
    (`pagoda.generation_config` reads them; `auto` reads the folder of the model the
    schedulers report, once, when this machine can see it);
  * `--enable-prompt-tokens-details`: usage carries `prompt_tokens_details.cached_tokens`
    (without it, no details, as in vLLM);
  * `--enable-force-include-usage`: every stream ends with a usage chunk, asked or not;
  * `--stream-interval N` (default 1): a stream's deltas go out every N tokens (its
    first at once, its last when it ends; generation/stream_interval.py), less CPU per
    token for the gateway and the client, the same text;
  * `--enable-log-requests` (`--disable-log-requests`, the default, turns it off):
    one INFO line per request with its prompt, params and token ids, each cut to
    `--max-log-len` characters/ids.
Pagoda's own, for a cluster that serves the outside world:
  * `--migration-limit N` (default 3): how often one choice may move to another replica
    when its replica goes away mid-stream (generation/migration.py); 0 ends it with an error
    instead;
  * `--shutdown-grace-period S`: on SIGTERM, seconds in-flight streams get to finish
    (the chart derives it from the pod's terminationGracePeriodSeconds);
  * `--trust-request-chat-template` (vLLM's): without it a request that brings its own
    chat template gets a 400;
  * `--metrics-require-key`: /metrics asks for the API key too;
  * the request limits (limits/request_limits.py).
`add_uvicorn_args`/`uvicorn_kwargs`: `--ssl-keyfile`, `--ssl-certfile`, `--ssl-ca-certs`,
`--ssl-cert-reqs` (HTTPS), `--root-path` (behind a path-prefix proxy),
`--uvicorn-log-level` and `--disable-uvicorn-access-log`, handed to uvicorn as vLLM does.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from pagoda.config import DEFAULT_MAX_LOGPROBS
from pagoda.generation_config import FIELDS as GENERATION_FIELDS
from pagoda.generation_config import (default_max_tokens, load_generation_defaults,
                                      parse_override)
from pagoda.json_flag import json_object
from pagoda.multimodal.processing import parse_limit_mm_per_prompt
from pagoda.reasoning import get_reasoning_parser
from pagoda.services.gateway.generation.stream_interval import DEFAULT_STREAM_INTERVAL
from pagoda.services.gateway.limits.request_limits import RequestLimits, add_limit_args
from pagoda.services.gateway.openai.responses_api.store import (DEFAULT_MAX_BYTES,
                                                                DEFAULT_MAX_STORED_RESPONSES,
                                                                DEFAULT_TTL_S)
from pagoda.services.gateway.openai.tool_parsers import get_tool_parser

request_logger = logging.getLogger("pagoda.services.gateway.requests")
# Sampling fields a generation config may fill (max_tokens is resolved separately);
# the library's one list of them, so a new field is named once.
_FILLABLE = tuple(name for name in GENERATION_FIELDS.values() if name != "max_tokens")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Flags that exist on the engine too: `pagoda serve` defines them once (EngineArgs)
# and passes them on; the gateway on its own defines them here.
ENGINE_SHARED = ("max_logprobs", "generation_config", "override_generation_config",
                 "reasoning_parser", "enable_sleep_mode")
DEFAULT_MIGRATION_LIMIT = 3
# The chart's default terminationGracePeriodSeconds (60) less its preStop sleep (5) and
# a margin (5) for the lifespan shutdown: the chart passes its own values' difference.
DEFAULT_SHUTDOWN_GRACE_S = 50.0


@dataclass
class ServingOptions:
    """Invariant: built once at start-up and never changed, except the cache of the
    generation defaults of `generation_config="auto"`, filled on first use."""

    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # The Responses API's bounded store (openai/responses_api/store.py); 0: `store` is ignored.
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    # In the cluster's Redis (through the kv-cache-manager): seconds kept, bytes at most.
    responses_store_ttl: int = DEFAULT_TTL_S
    max_stored_response_bytes: int = DEFAULT_MAX_BYTES
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    stream_interval: int = DEFAULT_STREAM_INTERVAL
    shutdown_grace_period: float = DEFAULT_SHUTDOWN_GRACE_S
    trust_request_chat_template: bool = False
    metrics_require_key: bool = False
    # vLLM's --default-chat-template-kwargs: under each request's chat_template_kwargs.
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Tools and reasoning (openai/tools.py, openai/chat_output.py): --enable-auto-tool-choice with
    # --tool-call-parser NAME, --reasoning-parser NAME.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # --tool-server host:port,...: MCP servers whose tools the Responses API runs
    # (openai/responses_api/tool_server.py); None: none.
    tool_server: str | None = None
    # --enable-sleep-mode: serve /sleep, /wake_up and /is_sleeping (sleep/routes.py).
    enable_sleep_mode: bool = False
    # vLLM's --limit-mm-per-prompt ({"image": N}), checked before the tokenizer loads
    # anything (the tokenizer checks it again).
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    _defaults: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServingOptions":
        options = cls(args.max_logprobs, args.generation_config,
                      parse_override(args.override_generation_config),
                      args.enable_prompt_tokens_details, args.enable_force_include_usage,
                      args.enable_log_requests, args.max_log_len,
                      migration_limit=args.migration_limit,
                      stream_interval=args.stream_interval,
                      shutdown_grace_period=args.shutdown_grace_period,
                      trust_request_chat_template=args.trust_request_chat_template,
                      metrics_require_key=args.metrics_require_key,
                      limits=RequestLimits.from_args(args))
        options.max_stored_responses = args.max_stored_responses
        options.default_chat_template_kwargs = json_object(
            getattr(args, "default_chat_template_kwargs", None),
            "--default-chat-template-kwargs") or {}
        if options.max_stored_responses < 0:
            raise ValueError("--max-stored-responses must be 0 or more")
        options.responses_store_ttl = getattr(args, "responses_store_ttl", DEFAULT_TTL_S)
        options.max_stored_response_bytes = getattr(args, "max_stored_response_bytes",
                                                    DEFAULT_MAX_BYTES)
        if options.responses_store_ttl < 1 or options.max_stored_response_bytes < 1:
            raise ValueError("--responses-store-ttl and --max-stored-response-bytes must be "
                             "1 or more")
        if options.generation_config != "auto":  # a folder: fail at start-up, not per request
            options.generation_defaults(None)
        options.enable_auto_tool_choice = getattr(args, "enable_auto_tool_choice", False)
        options.tool_call_parser = getattr(args, "tool_call_parser", None)
        options.reasoning_parser = getattr(args, "reasoning_parser", None)
        options.tool_server = getattr(args, "tool_server", None)
        options.enable_sleep_mode = bool(getattr(args, "enable_sleep_mode", False))
        options.limit_mm_per_prompt = parse_limit_mm_per_prompt(
            getattr(args, "limit_mm_per_prompt", None))
        options.check_parsers()
        return options

    def check_parsers(self) -> None:
        """Unknown parser names, or auto tool choice without a parser: ValueError at start-up."""
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_call_parser:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser:
            get_reasoning_parser(self.reasoning_parser)

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser of tool_choice "auto", or None when auto tool choice is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def generation_defaults(self, model_path: str | None) -> dict[str, Any]:
        """SamplingParams defaults for the model at `model_path` (the schedulers')."""
        key = model_path if self.generation_config == "auto" else ""
        if key not in self._defaults:
            self._defaults[key] = load_generation_defaults(
                model_path, self.generation_config, self.override_generation_config)
        return self._defaults[key]

    def fill_defaults(self, body: Any, requested_max_tokens: int | None,
                      prompt_lens: list[int], model_path: str | None,
                      max_model_len: int) -> int | None:
        """Fill the sampling fields `body` leaves unset from the generation config;
        return the max_tokens to use (None: the rest of the context, as before)."""
        defaults = self.generation_defaults(model_path)
        for name in _FILLABLE:
            if name in defaults and getattr(body, name, None) is None:
                setattr(body, name, defaults[name])
        if requested_max_tokens is not None or "max_tokens" not in defaults or not prompt_lens:
            return requested_max_tokens
        room = max_model_len - max(prompt_lens)
        return default_max_tokens(defaults, room) if room > 0 else None

    def on_generation(self, gen: Any) -> None:
        """What the options change once a request's Generation is built."""
        gen.usage.report_details = self.enable_prompt_tokens_details
        gen.migration_limit = self.migration_limit
        gen.stream_interval = self.stream_interval
        if gen.requests:
            self.log_request(gen.request_id, gen.prompts, gen.requests[0].sampling_params)

    def log_request(self, request_id: str, prompts: list[Any], params: Any) -> None:
        """vLLM's "Received request" line, once per prompt (prompts: `.text`, `.token_ids`)."""
        if not self.enable_log_requests:
            return
        for prompt in prompts:
            text, ids = prompt.text, list(prompt.token_ids)
            if self.max_log_len is not None:
                text = text[:self.max_log_len] if text is not None else None
                ids = ids[:self.max_log_len]
            request_logger.info("Received request %s: prompt: %r, params: %s, "
                                "prompt_token_ids: %s", request_id, text, params, ids)


def add_serving_args(parser: argparse.ArgumentParser, engine_shared: bool = True) -> None:
    """The gateway's vLLM serving flags; `engine_shared=False` leaves out the ones a
    parser with the engine's flags (pagoda serve, run-batch) already has."""
    group = parser.add_argument_group("OpenAI serving (vLLM's flags)")
    if engine_shared:
        group.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
                           help="Most logprobs / prompt_logprobs a request may ask for "
                                "(-1: no limit).")
        group.add_argument("--generation-config", default="auto",
                           help="Default sampling parameters: 'auto' (the model folder's "
                                "generation_config.json), 'vllm' (none) or a folder.")
        group.add_argument("--override-generation-config", default=None, metavar="JSON",
                           help="Laid over the generation config.")
        group.add_argument("--reasoning-parser", default=None,
                           help="deepseek_r1, qwen3, granite, glm45, gpt_oss, kimi or mistral: chat answers carry the reasoning in "
                                "reasoning_content, apart from content.")
        group.add_argument("--enable-sleep-mode", action="store_true",
                           help="Serve POST /sleep?level=1|2, POST /wake_up[?tags=...] and "
                                "GET /is_sleeping, sent on to every replica (which need the "
                                "flag too); without it those paths are 404.")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto" (the default with tools): --tool-call-parser '
                            "reads the calls out of the answer.")
    group.add_argument("--tool-call-parser", default=None,
                       help="The model's tool-call format, vLLM's names: hermes, llama3_json, "
                            "mistral, pythonic, qwen3_coder, deepseek_v3, granite, kimi_k2, "
                            "glm45, openai, llama4_pythonic, ...")
    group.add_argument("--tool-server", default=None,
                       help="Comma-separated MCP servers (host:port: its SSE endpoint, or a "
                            "URL) whose tools the Responses API runs for tools of type mcp "
                            "(needs --enable-auto-tool-choice and --tool-call-parser).")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="Report prompt_tokens_details.cached_tokens in usage.")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="End every stream with a usage chunk, even if not asked.")
    group.add_argument("--stream-interval", type=_int_at_least(1), default=DEFAULT_STREAM_INTERVAL,
                       help="Tokens per streamed delta: 1 sends each token at once; a larger "
                            "value sends a stream's first token at once, then every N tokens "
                            "(and its end), which costs the server and the client less CPU per "
                            "token. The text is the same.")
    group.add_argument("--enable-log-requests", dest="enable_log_requests", action="store_true",
                       default=False, help="Log each request's prompt and parameters.")
    group.add_argument("--disable-log-requests", dest="enable_log_requests",
                       action="store_false", default=False, help="Do not log requests (the default).")
    group.add_argument("--max-log-len", type=int, default=None,
                       help="Characters / token ids of a prompt a request log line shows.")
    group.add_argument("--max-stored-responses", type=int,
                       default=DEFAULT_MAX_STORED_RESPONSES,
                       help="Responses API: most responses kept for previous_response_id and "
                            "GET /v1/responses/{id}, least recently used dropped first (0: "
                            "store nothing). With a kv-cache-manager the responses live in "
                            "the cluster's Redis instead, shared by every gateway replica.")
    group.add_argument("--responses-store-ttl", type=int, default=DEFAULT_TTL_S,
                       help="Responses API: seconds a stored response stays in the cluster's "
                            "Redis (then previous_response_id and GET find it no more).")
    group.add_argument("--max-stored-response-bytes", type=int, default=DEFAULT_MAX_BYTES,
                       help="Responses API: a response whose JSON (with its conversation) is "
                            "larger is not stored in Redis.")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="Always on in Pagoda: every response carries X-Request-Id.")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="Always on in Pagoda: /load reports the requests in flight.")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="Let requests bring their own chat template (chat_template, "
                            "or chat_template_kwargs.chat_template); refused with a 400 "
                            "otherwise. Templates render sandboxed, time- and size-bounded.")
    group.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                       help="Chat template kwargs every chat request gets (a JSON object, "
                            "e.g. '{\"enable_thinking\": false}'); a request's own "
                            "chat_template_kwargs override them key by key.")
    group.add_argument("--metrics-require-key", action="store_true",
                       help="With --api-key, /metrics asks for the key too (/health never).")
    group.add_argument("--migration-limit", type=_int_at_least(0),
                       default=DEFAULT_MIGRATION_LIMIT,
                       help="How often one completion may move to another replica when its "
                            "replica dies, stops answering or drains out of time mid-stream "
                            "(0: the client gets an error instead).")
    group.add_argument("--shutdown-grace-period", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                       help="On SIGTERM: seconds in-flight requests get to finish before the "
                            "gateway exits (keep it under the pod's termination grace period "
                            "less its preStop sleep).")
    add_limit_args(parser)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type`: an int of at least `minimum`, else a message saying so."""
    def parse(value: str) -> int:
        number = int(value)
        if number < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return number
    parse.__name__ = "int"  # argparse's "invalid int value" for a non-number
    return parse


def add_uvicorn_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server (uvicorn)")
    group.add_argument("--ssl-keyfile", default=None, help="Serve HTTPS with this private key.")
    group.add_argument("--ssl-certfile", default=None, help="... and this certificate.")
    group.add_argument("--ssl-ca-certs", default=None,
                       help="CA certificates to verify clients against.")
    group.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                       help="Client certificates: 0 not asked, 1 optional, 2 required.")
    group.add_argument("--root-path", default=None,
                       help="The path prefix of a proxy in front of the gateway.")
    group.add_argument("--uvicorn-log-level", default="warning", choices=UVICORN_LOG_LEVELS,
                       help="uvicorn's own log level (default: warning).")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="No access log lines (they show at --uvicorn-log-level info).")


def uvicorn_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as `uvicorn.run` keyword arguments."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    # log_config None: uvicorn's loggers (access lines too) go through the service's
    # logging, to stderr in Pagoda's format (or the user's VLLM_LOGGING_CONFIG_PATH);
    # uvicorn's own config would send access lines to stdout, which `pagoda serve` drops.
    kwargs: dict[str, Any] = {"log_level": args.uvicorn_log_level, "log_config": None,
                              "access_log": not args.disable_uvicorn_access_log}
    if args.ssl_keyfile:
        kwargs.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                      ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)
    if args.root_path:
        kwargs["root_path"] = args.root_path
    return kwargs


def route_path(scope: dict) -> str:
    """The request's path as the app routes it. With --root-path, uvicorn puts the
    prefix in front of `scope["path"]` (`/proxy/v1/models`); middleware that matches
    paths (the API-key guard, metrics) must strip it as Starlette's router does, or
    `/v1/...` would not match and the API key would not be asked for."""
    path, root = scope["path"], scope.get("root_path") or ""
    return path[len(root):] or "/" if root and path.startswith(root) else path


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The serving and uvicorn flags the user set, re-rendered for the gateway
    (`pagoda serve`); those left at their default are not passed."""
    reference = argparse.ArgumentParser(add_help=False)
    add_serving_args(reference)
    add_uvicorn_args(reference)
    flags: list[str] = []
    for action in reference._actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreConstAction):
            if value == action.const:  # the switch that sets this value
                flags.append(flag)
        else:
            flags += [flag, str(value)]
    return flags
