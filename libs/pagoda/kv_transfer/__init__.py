"""Prefill/decode disaggregation in the library: roles, transfer parameters, the
prefill side's leases and the decode side's block imports. No transport here: the
gRPC transport between gpu-workers lives in `pagoda.services` (libs/pagoda never
imports grpc). Import the submodules directly; this package imports nothing."""
