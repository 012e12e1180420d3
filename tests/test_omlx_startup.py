"""The start-up hook: the .pth line costs nothing unless MLX_RECOVERY_ENABLE is set, and
then oMLX is instrumented the moment its scheduler module is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

omlx = pytest.importorskip(
    "omlx.scheduler", reason="oMLX (flyto-mlx) is not installed; CI installs it for these tests"
)

from hooked_python import HOOKS_DIR, run_python
from mlx_recovery_plugin.hosts import startup
from mlx_recovery_plugin.hosts.startup import PostImportFinder, enabled, install

PTH = HOOKS_DIR / "mlx_recovery_plugin.pth"


def test_the_pth_file_is_one_line_that_only_reads_the_variable() -> None:
    lines = [line for line in PTH.read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("import os;")
    assert "MLX_RECOVERY_ENABLE" in lines[0]


@pytest.mark.parametrize("value", [None, "0", "false", ""])
def test_without_the_variable_the_hook_loads_nothing(value: str | None) -> None:
    env = {} if value is None else {"MLX_RECOVERY_ENABLE": value}
    got = run_python(
        """
        print(json.dumps({
            "loaded": sorted(m for m in sys.modules if m.startswith("mlx_recovery_plugin")),
            "finders": [type(f).__name__ for f in sys.meta_path],
        }))
        """,
        **env,
    )
    assert got["loaded"] == []
    assert "PostImportFinder" not in got["finders"]


def test_with_the_variable_oMLX_is_instrumented_when_its_scheduler_is_imported() -> None:
    got = run_python(
        """
        before = {
            "omlx": "omlx.scheduler" in sys.modules,
            "finder": any(type(f).__name__ == "PostImportFinder" for f in sys.meta_path),
        }
        import omlx.scheduler
        from omlx.scheduler import Scheduler
        from omlx.engine_core import EngineCore
        after_scheduler = {
            "step": getattr(Scheduler.step, "__mlx_recovery_wrapper__", False),
            "close": getattr(EngineCore.close, "__mlx_recovery_wrapper__", False),
            "loader": type(omlx.scheduler.__loader__).__name__,
        }
        import omlx.server
        print(json.dumps({
            "before": before,
            "after_scheduler": after_scheduler,
            "finder_left": any(type(f).__name__ == "PostImportFinder" for f in sys.meta_path),
        }))
        """,
        MLX_RECOVERY_ENABLE="1",
        MLX_RECOVERY_CONTROL_SOCKET="off",
    )
    assert got["before"] == {"omlx": False, "finder": True}
    assert got["after_scheduler"] == {"step": True, "close": True, "loader": "SourceFileLoader"}
    assert got["finder_left"] is False


# -- the finder itself ---------------------------------------------------------------------


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("mlxr_hook_probe")]:
        del sys.modules[name]


def test_the_finder_calls_back_after_the_module_ran_and_then_leaves(module_dir: Path) -> None:
    (module_dir / "mlxr_hook_probe_a.py").write_text("VALUE = 41 + 1\n")
    seen: list[int] = []
    finder = PostImportFinder()
    finder.watch("mlxr_hook_probe_a", lambda module: seen.append(module.VALUE))
    finder.install()
    try:
        import mlxr_hook_probe_a  # type: ignore[import-not-found]
    finally:
        finder.remove()
    assert seen == [42]
    assert finder not in sys.meta_path
    assert type(mlxr_hook_probe_a.__loader__).__name__ == "SourceFileLoader"


def test_a_failing_callback_does_not_break_the_import(module_dir: Path) -> None:
    (module_dir / "mlxr_hook_probe_b.py").write_text("VALUE = 7\n")

    def explode(module: ModuleType) -> None:
        raise RuntimeError("adapter bug")

    finder = PostImportFinder()
    finder.watch("mlxr_hook_probe_b", explode)
    finder.install()
    try:
        import mlxr_hook_probe_b  # type: ignore[import-not-found]
    finally:
        finder.remove()
    assert mlxr_hook_probe_b.VALUE == 7


def test_a_module_already_imported_is_handled_at_once(module_dir: Path) -> None:
    (module_dir / "mlxr_hook_probe_c.py").write_text("VALUE = 3\n")
    import mlxr_hook_probe_c  # type: ignore[import-not-found]  # noqa: F401

    seen: list[int] = []
    finder = PostImportFinder()
    finder.watch("mlxr_hook_probe_c", lambda module: seen.append(module.VALUE))
    assert seen == [3] and finder.watching == []


def test_install_is_a_no_op_unless_enabled() -> None:
    assert not enabled({}) and not enabled({"MLX_RECOVERY_ENABLE": "no"})
    assert enabled({"MLX_RECOVERY_ENABLE": " Yes "})
    assert install({}) is None
    assert startup._finder is None


def test_enabled_but_no_host_imported_loads_no_mlx_and_no_settings() -> None:
    got = run_python(
        """
        print(json.dumps({
            "mlx": "mlx.core" in sys.modules,
            "pydantic": "pydantic" in sys.modules,
            "finders": [type(f).__name__ for f in sys.meta_path],
        }))
        """,
        MLX_RECOVERY_ENABLE="1",
    )
    assert got["mlx"] is False and got["pydantic"] is False
    assert "PostImportFinder" in got["finders"]


def test_a_failing_hook_import_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    broken = tmp_path / "mlx_recovery_plugin"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('pluggy is missing')\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MLX_RECOVERY_")}
    environ.update(MLX_RECOVERY_ENABLE="1", PYTHONPATH=str(tmp_path))
    code = f"import site\nsite.addsitedir({str(HOOKS_DIR)!r})\nprint('started')\n"
    # -S: only the hooks/ copy of the line runs, not one installed in site-packages.
    done = subprocess.run([sys.executable, "-S", "-c", code], env=environ, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "started"
    assert "Traceback" not in done.stderr and "Error processing line" not in done.stderr
    assert done.stderr.strip() == "mlx-recovery: start-up hook not installed: ImportError('pluggy is missing')"
