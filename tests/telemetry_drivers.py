"""Drivers for the telemetry tests: what a worker process holds, as its final text."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any


class Threads:
    """Ends its turn with the worker's threads and the opentelemetry modules it loaded."""

    def run(self, ctx: Any) -> str:
        return json.dumps(
            {
                "threads": sorted(t.name for t in threading.enumerate()),
                "otel": sorted(m for m in sys.modules if m.startswith("opentelemetry")),
            }
        )
