"""Run a Triton kernel check in a child process with TRITON_INTERPRET=1, so the interpreter
setting never leaks into other tests; the script prints one JSON line of results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_interpreted(script: str, cases: Any, timeout: int = 600) -> Any:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
