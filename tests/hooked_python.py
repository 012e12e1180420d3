"""Fresh interpreters that process hooks/*.pth, for the start-up tests of each host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

HOOKS_DIR = Path(__file__).resolve().parents[1] / "hooks"


def run_python(code: str, **env: str) -> Any:
    """Run ``code`` in a fresh interpreter that processes hooks/*.pth; it prints JSON.
    The environment is this one without any ``MLX_RECOVERY_*`` variable, plus ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MLX_RECOVERY_")}
    environ.update(env)
    prologue = f"import site, sys, json\nsite.addsitedir({str(HOOKS_DIR)!r})\n"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", prologue + textwrap.dedent(code)],
        env=environ, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
