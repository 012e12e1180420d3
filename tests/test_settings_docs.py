"""The README's settings table says what the code reads: every ``MLX_RECOVERY_*`` setting
once, none that is not one, each with its real default (the table was once lost in an
edit of the section above it, and no test noticed)."""

from __future__ import annotations

import enum
import re
from pathlib import Path

from mlx_recovery_plugin.settings import RecoverySettings, env_name

README = Path(__file__).resolve().parents[1] / "README.md"


def settings_rows() -> dict[str, str]:
    """Variable -> default cell, from the table under ``## Settings``."""
    text = README.read_text(encoding="utf-8")
    assert "\n## Settings\n" in text, "the README has no Settings section"
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        match = re.match(r"\| `(MLX_RECOVERY_[A-Z_]+)` \| ([^|]+) \|", line)
        if match:
            assert match.group(1) not in rows, f"{match.group(1)} is in the table twice"
            rows[match.group(1)] = match.group(2).strip()
    return rows


def test_every_setting_is_in_the_readme_table_with_its_default() -> None:
    rows = settings_rows()
    fields = RecoverySettings.model_fields
    assert set(rows) == {env_name(name) for name in fields}
    for name, field in fields.items():
        cell = rows[env_name(name)]
        default = field.default
        if isinstance(default, enum.Enum):
            assert cell == f"`{default.value}`", name
        elif isinstance(default, bool):
            assert cell == f"`{str(default).lower()}`", name
        elif isinstance(default, (int, float)):
            assert float(cell.strip("`").replace(",", "")) == float(default), name
