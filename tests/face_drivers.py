"""Test-only drivers for the protocol faces, loaded by workers as ``"face_drivers:Name"``."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any


class Chatty:
    """Writes to its stdout every way a careless driver or tool might, then answers."""

    def run(self, ctx: Any) -> str:
        print("noise from print", flush=True)
        os.write(1, b"noise from fd 1\n")
        subprocess.run([sys.executable, "-c", "print('noise from a child')"], check=True)
        ctx.say("said on the transcript")
        return "said on the transcript"
