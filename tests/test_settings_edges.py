"""Hostile settings values get one clear error naming the variable, and large ones stay
cheap (issue 22, 10)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from hooked_python import HOOKS_DIR
from mlx_recovery_plugin import cli
from mlx_recovery_plugin.settings import SettingsError, load_settings, repeated_keys


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("MLX_RECOVERY_"):
            monkeypatch.delenv(name)


DEEP = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"m": ' * 50_000 + "1" + "}" * 50_000


@pytest.mark.parametrize("value", [DEEP, DEEP_OBJECT], ids=["array", "object"])
def test_deeply_nested_models_is_a_settings_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("MLX_RECOVERY_MODELS", value)
    with pytest.raises(SettingsError, match="MLX_RECOVERY_MODELS"):
        load_settings()


def test_the_config_command_prints_the_nesting_error_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MLX_RECOVERY_MODELS", DEEP)
    assert cli.main(["config"]) == 2
    err = capsys.readouterr().err
    assert "MLX_RECOVERY_MODELS" in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["null", "[]", "5", '"tiny"'])
def test_models_that_is_not_a_json_object_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MLX_RECOVERY_MODELS", value)
    with pytest.raises(SettingsError, match=r"MLX_RECOVERY_MODELS.*JSON object"):
        load_settings()


def test_ten_thousand_model_keys_load_and_a_duplicate_among_them_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    models = {f"org/model-{i}": {"enabled": i % 2 == 0} for i in range(10_500)}
    monkeypatch.setenv("MLX_RECOVERY_MODELS", json.dumps(models))
    settings = load_settings()
    assert len(settings.models) == 10_500 and settings.for_model("org/model-10498").enabled
    monkeypatch.setenv("MLX_RECOVERY_MODELS", json.dumps(models)[:-1] + ', "org/model-7": {}}')
    with pytest.raises(SettingsError, match="duplicate keys 'org/model-7'"):
        load_settings()


class CountingKey(str):
    """A key that counts how often it is compared: the duplicate check's cost."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        CountingKey.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_the_duplicate_check_compares_keys_a_linear_number_of_times() -> None:
    keys = [CountingKey(f"model-{i}") for i in range(2_000)]
    CountingKey.comparisons = 0
    assert repeated_keys([(k, {}) for k in keys]) == []
    # Counting each key against the whole list compared 2,000 x 2,000 = 4,000,000 times.
    assert CountingKey.comparisons <= 2 * len(keys)


def test_the_not_a_setting_warning_is_logged_once_per_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLX_RECOVERY_BUGDET_PCTT", "50")  # a name no other test uses
    with caplog.at_level(logging.WARNING, logger="mlx_recovery_plugin.settings"):
        for _ in range(3):  # the plugin manager, the recovery plugin and the adopter each load
            load_settings()
    assert caplog.text.count("MLX_RECOVERY_BUGDET_PCTT is not a setting") == 1


@pytest.mark.parametrize("value", ["2", "maybe", "enable"])
def test_an_enable_value_that_is_neither_true_nor_false_is_an_error(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("MLX_RECOVERY_ENABLE", value)
    with pytest.raises(SettingsError, match="MLX_RECOVERY_ENABLE"):
        load_settings()
    # The start-up hook reads the variable itself: it says so on stderr, not silently off.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MLX_RECOVERY_")}
    environ.update(MLX_RECOVERY_ENABLE=value, MLX_RECOVERY_CONTROL_SOCKET="off")
    code = f"import site, sys\nsite.addsitedir({str(HOOKS_DIR)!r})\n" + textwrap.dedent(
        """
        print(sorted(m for m in sys.modules if m.startswith("mlx_recovery_plugin.hosts.startup")))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"MLX_RECOVERY_ENABLE={value!r}" in done.stderr and "not attached" in done.stderr
    assert "Traceback" not in done.stderr
