"""The served control plane at GPU step rates (not a pytest file): the same as

    pagoda bench control-plane [--step-ms 50,25,15] [--concurrency 64,128,256] [--duration 20]

Starts `pagoda serve --simulated-device` once per step time and prints one table; see
`pagoda bench control-plane --help` (services/bench/control_plane.py) for the columns.
"""

from __future__ import annotations

import sys

from pagoda.services.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "control-plane", *sys.argv[1:]]))
