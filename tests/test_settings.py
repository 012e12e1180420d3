"""Settings come from MLX_RECOVERY_* variables; bad values fail loudly and name the variable."""

from __future__ import annotations

import logging

import pytest

from mlx_recovery_plugin.settings import (
    AdoptMode,
    SettingsError,
    describe_settings,
    load_settings,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.upper().startswith("MLX_RECOVERY_"):
            monkeypatch.delenv(name)


def test_defaults_leave_recovery_off() -> None:
    s = load_settings()
    assert s.budget_pct == 0
    assert s.idle_steps == 2
    assert s.slice_tokens is None
    assert s.adopter_mode is AdoptMode.CLONE
    assert not (s.budget_pct > 0 and s.for_model("any/model").enabled)


def test_per_model_json_keyed_by_ids_with_slashes_dashes_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RECOVERY_BUDGET_PCT", "10")
    monkeypatch.setenv(
        "MLX_RECOVERY_MODELS",
        '{"mlx-community/Qwen3.5-0.8B-4bit": {"enabled": true, "slice_tokens": 512}}',
    )
    s = load_settings()
    assert (s.budget_pct > 0 and s.for_model("mlx-community/Qwen3.5-0.8B-4bit").enabled)
    assert not (s.budget_pct > 0 and s.for_model("other/model").enabled)
    assert s.slice_tokens_for("mlx-community/Qwen3.5-0.8B-4bit", host_prefill_step=2048) == 512
    assert s.slice_tokens_for("other/model", host_prefill_step=2048) == 2048


def test_opted_in_model_stays_off_while_budget_is_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RECOVERY_MODELS", '{"m": {"enabled": true}}')
    assert not (load_settings().budget_pct > 0 and load_settings().for_model("m").enabled)


def test_process_slice_size_overrides_host_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RECOVERY_SLICE_TOKENS", "256")
    assert load_settings().slice_tokens_for("m", host_prefill_step=2048) == 256


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("MLX_RECOVERY_BUDGET_PCT", "150", "<= 100"),
        ("MLX_RECOVERY_BUDGET_PCT", "-1", ">= 0"),
        ("MLX_RECOVERY_IDLE_STEPS", "0", ">= 1"),
        ("MLX_RECOVERY_BUDGET_WINDOW_S", "0", ">= 0.1"),
        ("MLX_RECOVERY_ADOPTER_MODE", "slice", "clone, trim"),
        ("MLX_RECOVERY_SLICE_TOKENS", "lots", "integer"),
    ],
)
def test_bad_value_names_the_variable_and_allowed_range(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, expected: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert variable in str(info.value)
    assert expected in str(info.value)


def test_every_bad_variable_is_reported_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RECOVERY_BUDGET_PCT", "101")
    monkeypatch.setenv("MLX_RECOVERY_IDLE_STEPS", "-3")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert "MLX_RECOVERY_BUDGET_PCT" in str(info.value)
    assert "MLX_RECOVERY_IDLE_STEPS" in str(info.value)


def test_bad_model_entry_names_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RECOVERY_MODELS", '{"org/m-1.5B": {"enabled": true, "slice_tokens": 4}}')
    with pytest.raises(SettingsError, match=r"MLX_RECOVERY_MODELS \[org/m-1.5B\]\.\[slice_tokens\]"):
        load_settings()


def test_unknown_model_key_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RECOVERY_MODELS", '{"m": {"enabeld": true}}')
    with pytest.raises(SettingsError, match="enabeld"):
        load_settings()


def test_models_json_syntax_error_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RECOVERY_MODELS", "{not json")
    with pytest.raises(SettingsError, match="MLX_RECOVERY_MODELS: not valid JSON"):
        load_settings()


def test_describe_says_where_each_value_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RECOVERY_BUDGET_PCT", "12.5")
    rows = {row.variable: row for row in describe_settings(load_settings())}
    assert rows["MLX_RECOVERY_BUDGET_PCT"].value == 12.5
    assert rows["MLX_RECOVERY_BUDGET_PCT"].source == "environment"
    assert rows["MLX_RECOVERY_IDLE_STEPS"].source == "default"
    assert rows["MLX_RECOVERY_ADOPTER_MODE"].value == "clone"


def test_trim_keep_fraction_reaches_the_adopter(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_recovery_plugin.adopter.plugin import AdopterPlugin

    monkeypatch.setenv("MLX_RECOVERY_ADOPTER_TRIM_KEEP_FRACTION", "0.25")
    assert AdopterPlugin().trim_keep_fraction == 0.25
    monkeypatch.setenv("MLX_RECOVERY_ADOPTER_TRIM_KEEP_FRACTION", "1.5")
    with pytest.raises(SettingsError, match="MLX_RECOVERY_ADOPTER_TRIM_KEEP_FRACTION"):
        load_settings()


def test_a_misspelt_variable_is_named_with_the_closest_setting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLX_RECOVERY_BUGDET_PCT", "50")
    with caplog.at_level(logging.WARNING, logger="mlx_recovery_plugin.settings"):
        settings = load_settings()
    assert settings.budget_pct == 0.0
    assert "MLX_RECOVERY_BUGDET_PCT is not a setting and is ignored; did you mean MLX_RECOVERY_BUDGET_PCT?" in caplog.text


def test_known_variables_raise_no_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MLX_RECOVERY_BUDGET_PCT", "5")
    monkeypatch.setenv("MLX_RECOVERY_OPENBLAS", "off")
    with caplog.at_level(logging.WARNING, logger="mlx_recovery_plugin.settings"):
        load_settings()
    assert "is not a setting" not in caplog.text


def test_duplicate_model_keys_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_RECOVERY_MODELS", '{"m": {"enabled": true}, "m": {"enabled": false}}')
    with pytest.raises(SettingsError, match="MLX_RECOVERY_MODELS: duplicate keys 'm'"):
        load_settings()


def test_a_vanishing_budget_window_is_refused_with_its_minimum(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window of 1e-308 s used to pass validation and overflow later in the budget."""
    monkeypatch.setenv("MLX_RECOVERY_BUDGET_WINDOW_S", "1e-308")
    with pytest.raises(SettingsError, match=r"MLX_RECOVERY_BUDGET_WINDOW_S.*greater than or equal to 0\.1"):
        load_settings()


def test_the_rapid_adapters_block_variable_is_a_known_setting_with_the_same_default() -> None:
    # The adapter reads it without loading the settings; the two must not drift apart.
    from mlx_recovery_plugin.hosts.rapid.instrumentor import BLOCK_VARIABLE, DEFAULT_BLOCK_TOKENS
    from mlx_recovery_plugin.settings import RecoverySettings, env_name, known_variables

    assert env_name("rapid_block_tokens") == BLOCK_VARIABLE and BLOCK_VARIABLE in known_variables()
    assert RecoverySettings.model_fields["rapid_block_tokens"].default == DEFAULT_BLOCK_TOKENS
