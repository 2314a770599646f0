"""The fault spec a cluster's processes read (pagoda/fault_injection.py), started with
PAGODA_FAULT_INJECT=@<its path>, replaced whole on every change."""

from __future__ import annotations

import json
import os


class FaultFile:
    """The cluster's fault spec (pagoda/fault_injection.py): `arm` replaces it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.serial = 0
        self.arm()

    @property
    def env(self) -> dict[str, str]:
        return {"PAGODA_FAULT_INJECT": f"@{self.path}"}

    def arm(self, *faults: dict) -> None:
        """Exactly `faults` armed from now on (none: every fault off); hit counts restart
        (each arming is new to the processes: it carries a serial number)."""
        self.serial += 1
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump([{**fault, "serial": self.serial} for fault in faults], f)
        os.replace(tmp, self.path)  # whole: no process reads half a spec

