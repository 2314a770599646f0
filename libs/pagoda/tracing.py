"""OpenTelemetry tracing for every Pagoda process, off unless asked for.

`--otlp-traces-endpoint URL` (vLLM's flag) makes a process export its spans over
OTLP/gRPC (`http://host:4317` is plaintext, `https://` uses TLS; set
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf` for OTLP/HTTP if its exporter
is installed). The standard `OTEL_*` variables (sampler, batch delay, headers)
apply. Without the flag nothing is installed: `get_tracer()` is OpenTelemetry's
no-op tracer, the gRPC interceptors are not added, and hot paths test
`is_enabled()` before building any span, so tracing costs nothing.

Context crosses processes as W3C trace context (`traceparent`, `tracestate`):
in gRPC metadata between services (see pagoda.services.common.tracing) and in
HTTP headers at the gateway, so one trace id spans every hop.

The engine core never imports this module; the service shells and the offline
entry points do.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, MutableMapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import pagoda

logger = logging.getLogger(__name__)
TRACER_NAME = "pagoda"
_PROPAGATOR = TraceContextTextMapPropagator()
_provider = None  # the SDK TracerProvider while tracing is on


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otlp-traces-endpoint", default=None,
                        help="Export OpenTelemetry traces to this OTLP endpoint, e.g. "
                             "http://127.0.0.1:4317 (default: tracing off).")


def init_tracing(service_name: str, otlp_traces_endpoint: str | None = None,
                 exporter=None) -> bool:
    """Turn tracing on for this process if an endpoint (or, in tests, an exporter
    such as `InMemorySpanExporter`) is given; returns whether it is on.

    Spans go through a BatchSpanProcessor to OTLP (`OTEL_BSP_SCHEDULE_DELAY`
    sets how often it flushes) or a SimpleSpanProcessor to a given exporter.
    """
    global _provider
    if exporter is None and not otlp_traces_endpoint:
        return False
    # lazy: tracing is off by default: the SDK loads only when it is turned on
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    resource = Resource.create({"service.name": f"pagoda-{service_name}",
                                "service.version": pagoda.__version__,
                                "pagoda.service": service_name})
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(otlp_traces_endpoint)))
        logger.info("exporting traces to %s", otlp_traces_endpoint)
    if _provider is not None:
        _provider.shutdown()
    _provider = provider
    return True


def _otlp_exporter(endpoint: str):
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        if protocol == "grpc":
            # lazy: the OTLP exporters are optional packages
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            # lazy: the OTLP exporters are optional packages
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise ValueError(f"unsupported OTEL_EXPORTER_OTLP_TRACES_PROTOCOL {protocol!r}")
    except ImportError as exc:
        raise SystemExit(f"--otlp-traces-endpoint needs the OTLP exporter for {protocol}: "
                         f"pip install opentelemetry-exporter-otlp ({exc})") from exc
    return OTLPSpanExporter(endpoint=endpoint)


def shutdown_tracing() -> None:
    """Flush buffered spans and turn tracing off (call before the process exits)."""
    global _provider
    if _provider is not None:
        provider, _provider = _provider, None
        provider.shutdown()


def is_enabled() -> bool:
    return _provider is not None


def get_tracer() -> trace.Tracer:
    """The process's tracer; OpenTelemetry's no-op tracer while tracing is off."""
    if _provider is None:
        return trace.NoOpTracer()
    return _provider.get_tracer(TRACER_NAME)


def inject(carrier: MutableMapping[str, str], context: Context | None = None) -> None:
    """Write `traceparent` (and `tracestate`) for the current or given context."""
    _PROPAGATOR.inject(carrier, context=context)


def extract(carrier: Mapping[str, str]) -> Context:
    """The context a peer sent (an empty one when it sent none)."""
    return _PROPAGATOR.extract(carrier)
