"""What ships: every module of the wheel imports without the test-only packages, and the
project's lab (tests/lab) is not part of it."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

import mlx_recovery_plugin

# The contract suite is a pytest plugin for host authors: pytest is what it is for.
PYTEST_PLUGINS = {"mlx_recovery_plugin.testing.contract"}


def shipped_modules() -> list[str]:
    return sorted(
        info.name
        for info in pkgutil.walk_packages(mlx_recovery_plugin.__path__, "mlx_recovery_plugin.")
        if info.name not in PYTEST_PLUGINS
    )


def test_every_shipped_module_imports_without_hypothesis_or_the_lab() -> None:
    modules = shipped_modules()
    assert "mlx_recovery_plugin.bench.server.cli" in modules and "mlx_recovery_plugin.recovery.service" in modules
    script = (
        "import sys, importlib\n"
        "for blocked in ('hypothesis', 'lab', 'pytest'):\n"
        "    sys.modules[blocked] = None\n"
        "failed = []\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        if getattr(exc, 'name', None) in ('hypothesis', 'lab', 'pytest'):\n"
        "            failed.append(f'{name}: {exc}')\n"
        "print('\\n'.join(failed))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MLX_RECOVERY_ENABLE"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", f"shipped modules that need a test-only package:\n{done.stdout}"


def test_the_lab_benches_are_not_in_the_package() -> None:
    names = set(shipped_modules())
    for lab_only in ("bench.faults", "bench.machines", "bench.interference", "bench.startup", "testing.machines"):
        assert f"mlx_recovery_plugin.{lab_only}" not in names
