"""The start-up hook where no host is imported: it reads the entry points without
importlib.metadata, waits for each adapter's host package, and loads an adapter only once
its host is imported. Runs without any real host (oMLX's own checks are in
test_omlx_startup.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from mlx_recovery_plugin.hosts.entry_scan import (
    HOST_PACKAGES_ENTRY_POINT_GROUP,
    HOSTS_ENTRY_POINT_GROUP,
    parse_group,
    scan_groups,
)

HOOKS_DIR = Path(__file__).resolve().parents[1] / "hooks"

# Loaded by the adapter protocol, the plugins or the host: none may be paid for by a
# process that never imports a host.
HEAVY = ("pluggy", "importlib.metadata", "asyncio", "mlx", "mlx.core", "pydantic", "typing", "logging")

ADAPTER = '''
import sys

class Adapter:
    name = "fakehost"
    trigger_module = "fakehost.sched"
    is_instrumented = False

    def host_importable(self):
        return True

    def instrument(self, pm=None):
        sys.modules["fakehost.sched"].INSTRUMENTED = True
        return True

    def uninstrument(self):
        pass
'''


def write_fake_host(root: Path, *, declare_package: bool = True) -> None:
    """A host package ``fakehost`` and a distribution with an adapter for it."""
    (root / "fakehost").mkdir()
    (root / "fakehost" / "__init__.py").write_text("")
    (root / "fakehost" / "sched.py").write_text("INSTRUMENTED = False\n")
    (root / "fake_mlxr_adapter.py").write_text(ADAPTER)
    info = root / "fake_mlxr_adapter-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-mlxr-adapter\nVersion: 1.0\n")
    points = f"[{HOSTS_ENTRY_POINT_GROUP}]\nfakehost = fake_mlxr_adapter:Adapter\n"
    if declare_package:
        points += f"\n[{HOST_PACKAGES_ENTRY_POINT_GROUP}]\nfakehost = fakehost\n"
    (info / "entry_points.txt").write_text(points)


def run_python(code: str, pythonpath: Path) -> dict:
    """``code`` in a fresh interpreter with the hook enabled and ``pythonpath`` first on
    sys.path; it prints one JSON line."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MLX_RECOVERY_")}
    environ.update(MLX_RECOVERY_ENABLE="1", MLX_RECOVERY_CONTROL_SOCKET="off", PYTHONPATH=str(pythonpath))
    prologue = f"import site, sys, json\nsite.addsitedir({str(HOOKS_DIR)!r})\n"
    done = subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(code)],
        env=environ, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


STATE = f"""
finder = next((f for f in sys.meta_path if type(f).__name__ == "PostImportFinder"), None)
def state():
    return {{
        "heavy": sorted(m for m in {HEAVY!r} if m in sys.modules),
        "adapter": "fake_mlxr_adapter" in sys.modules,
        "watching": [] if finder is None or finder not in sys.meta_path else finder.watching,
    }}
"""


def test_enabled_with_no_host_imported_loads_nothing_heavy_and_waits_for_the_host_package(tmp_path: Path) -> None:
    write_fake_host(tmp_path)
    got = run_python(
        STATE + """
before = state()
import fakehost.sched
after = state()
print(json.dumps({"before": before, "after": after, "instrumented": fakehost.sched.INSTRUMENTED}))
""",
        tmp_path,
    )
    assert got["before"]["heavy"] == [] and got["before"]["adapter"] is False
    assert "fakehost" in got["before"]["watching"]
    # Importing the host loads the adapter, which instruments the trigger module.
    assert got["after"]["adapter"] is True and got["instrumented"] is True
    assert not {"fakehost", "fakehost.sched"} & set(got["after"]["watching"])


def test_an_adapter_that_names_no_host_package_is_loaded_at_start(tmp_path: Path) -> None:
    write_fake_host(tmp_path, declare_package=False)
    got = run_python(
        STATE + """
before = state()
import fakehost.sched
print(json.dumps({"before": before, "instrumented": fakehost.sched.INSTRUMENTED}))
""",
        tmp_path,
    )
    assert got["before"]["adapter"] is True and "fakehost.sched" in got["before"]["watching"]
    assert got["instrumented"] is True


def test_a_host_that_is_not_installed_is_not_awaited(tmp_path: Path) -> None:
    write_fake_host(tmp_path)
    (tmp_path / "fakehost" / "__init__.py").unlink()
    (tmp_path / "fakehost" / "sched.py").unlink()
    (tmp_path / "fakehost").rmdir()
    got = run_python(STATE + "print(json.dumps(state()))\n", tmp_path)
    assert "fakehost" not in got["watching"] and got["adapter"] is False


@pytest.mark.parametrize("group", ["console_scripts", "pytest11", HOSTS_ENTRY_POINT_GROUP, HOST_PACKAGES_ENTRY_POINT_GROUP])
def test_the_cheap_scan_reads_what_importlib_metadata_reads(group: str) -> None:
    expected = {ep.name: ep.value for ep in entry_points(group=group)}
    assert scan_groups([group])[group] == expected


def test_the_first_distribution_of_a_name_on_the_path_wins(tmp_path: Path) -> None:
    for folder, value in (("a", "first:Adapter"), ("b", "second:Adapter")):
        info = tmp_path / folder / "Some.Host-2.0.dist-info"
        info.mkdir(parents=True)
        (info / "entry_points.txt").write_text(f"[{HOSTS_ENTRY_POINT_GROUP}]\nhost = {value}\n")
    other = tmp_path / "b" / "other_host.egg-info"
    other.mkdir()
    (other / "entry_points.txt").write_text(f"[{HOSTS_ENTRY_POINT_GROUP}]\nother = third:Adapter\n")
    found = scan_groups([HOSTS_ENTRY_POINT_GROUP], [str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "missing")])
    assert found[HOSTS_ENTRY_POINT_GROUP] == {"host": "first:Adapter", "other": "third:Adapter"}


def test_parse_group_reads_one_section_and_skips_comments() -> None:
    text = "# c\n[console_scripts]\nx = a:b\n\n[wanted]\n; note\n one = pkg.mod:Obj [extra]\ntwo=pkg\n[after]\nthree = c\n"
    assert parse_group(text, "wanted") == {"one": "pkg.mod:Obj [extra]", "two": "pkg"}


def test_the_startup_bench_reports_the_hook_and_no_heavy_module(capsys: pytest.CaptureFixture[str]) -> None:
    from lab.cli import build_parser
    from lab.startup import measure_startup

    result = measure_startup(sys.executable, pairs=1)
    args = build_parser().parse_args(["startup", "--pairs", "1"])
    code = args.func(args)
    out, err = capsys.readouterr()
    if not result.hook_active:  # an editable install without the .pth copied in
        assert code == 2 and "is the .pth file installed?" in err
        return
    assert code == 0 and "heavy modules loaded: none" in out
    assert result.heavy_on == [] and result.modules_on > result.modules_off
