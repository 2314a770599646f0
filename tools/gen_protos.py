"""Generate the gRPC stubs from protos/ into services/_proto/ (git-ignored).

protoc names Python modules after the .proto paths (`pagoda/scheduler/v1/...` ->
`pagoda.scheduler.v1`), which would collide with the `pagoda` package itself, so
the generated imports are rewritten to live under `pagoda.services._proto`.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc
import grpc_tools

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "services" / "_proto"
IMPORT_RE = re.compile(r"^(from|import) pagoda\.", re.MULTILINE)


def main() -> int:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    if not sources:
        (OUT / "__init__.py").write_text("")
        return 0
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={OUT}",
            f"--pyi_out={OUT}", f"--grpc_python_out={OUT}", *sources]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    for path in OUT.rglob("*.py*"):
        text = path.read_text()
        path.write_text(IMPORT_RE.sub(lambda m: f"{m.group(1)} pagoda.services._proto.pagoda.", text))
    for folder in [OUT, *[p for p in OUT.rglob("*") if p.is_dir()]]:
        (folder / "__init__.py").touch()
    print(f"generated {len(sources)} proto file(s) into {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
