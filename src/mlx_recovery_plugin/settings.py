"""Settings from the environment (prefix ``MLX_RECOVERY_``), validated all at once.

The host's own per-model settings drop unknown keys, so the plugin keeps its own. A bad
value raises one :class:`SettingsError` that names the environment variable and the
allowed range; nothing starts half-configured.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from pydantic_settings import SettingsError as PydanticSettingsError

log = logging.getLogger(__name__)

ENV_PREFIX = "MLX_RECOVERY_"
# Variables of this prefix that are not settings: the OpenBLAS re-run of the demo and the
# benches (runner/blas.py) reads the first, and marks its child process with the second.
OPENBLAS_VARIABLE = "MLX_RECOVERY_OPENBLAS"
# Below this a window is no longer a window (and a share of it underflows): seconds.
MIN_BUDGET_WINDOW_S = 0.1
# The smallest share above 0 (off), percent: at the shortest window its allowance is
# 10 us; below it an allowance underflows and the wait for the next one overflows.
MIN_BUDGET_PCT = 0.01
OPENBLAS_REEXEC_VARIABLE = "MLX_RECOVERY_OPENBLAS_REEXEC"


def validate_budget_pct(pct: float) -> float:
    """``pct`` as a float: 0 (off) or in [``MIN_BUDGET_PCT``, 100], else ValueError
    naming the allowed values. The settings, the budget, the CLI and the admin route all
    check a share here."""
    if isinstance(pct, bool) or not isinstance(pct, (int, float)):
        raise ValueError(f"budget percentage must be a number in [0, 100], got {pct!r}")
    value = float(pct)
    if not math.isfinite(value) or not (value == 0.0 or MIN_BUDGET_PCT <= value <= 100.0):
        raise ValueError(
            f"budget percentage must be in [0, 100]: 0 (off) or at least {MIN_BUDGET_PCT:g}, got {pct!r}"
        )
    return value


class AdoptMode(str, Enum):
    CLONE = "clone"
    TRIM = "trim"


class PublishPolicy(str, Enum):
    """``auto``: publish only what makes the next turn cheaper than the host's other
    route (see :mod:`mlx_recovery_plugin.recovery.costs`); ``always``: publish every
    finished block."""

    AUTO = "auto"
    ALWAYS = "always"


class ModelSettings(BaseModel):
    """Per-model opt-in and overrides, one entry of ``MLX_RECOVERY_MODELS``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="recovery runs for this model")
    slice_tokens: int | None = Field(
        None, ge=16, le=65536, description="tokens per recovery slice (default: process-wide)"
    )
    idle_steps: int | None = Field(
        None, ge=1, le=1000, description="idle steps before a slice (default: process-wide)"
    )


class RecoverySettings(BaseSettings):
    """Process-wide settings. Each field is read from ``MLX_RECOVERY_<FIELD>``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", frozen=True, case_sensitive=False
    )

    enable: bool = Field(
        False,
        description="attach to installed hosts at start-up (the hooks/ .pth startup hook)",
    )
    budget_pct: float = Field(
        0.0, ge=0.0, le=100.0, description="share of wall time recovery may use; 0 = off"
    )
    budget_window_s: float = Field(
        10.0, ge=MIN_BUDGET_WINDOW_S, le=3600.0, description="length of one budget window, seconds"
    )
    slice_tokens: int | None = Field(
        None, ge=16, le=65536, description="tokens per slice; unset = the host's prefill step"
    )
    idle_steps: int = Field(2, ge=1, le=1000, description="consecutive idle steps before a slice")
    max_jobs_per_engine: int = Field(
        4, ge=1, le=256, description="recovery jobs kept per engine (least recent dropped)"
    )
    max_held_mib: float | None = Field(
        None, ge=0.0, le=1_048_576.0,
        description="memory that finished blocks held back (by the publish policy, or from an interrupted slice) may take, per engine (MiB); unset = an eighth of the device's memory (the machine's where MLX reports none), at least 256",
    )
    interruptible: bool = Field(
        True, description="abandon a slice between layers when foreground work arrives"
    )
    publish_policy: PublishPolicy = Field(
        PublishPolicy.AUTO,
        description="auto: publish only what makes the next turn cheaper than the host's other route; always: every finished block",
    )
    adopter_enabled: bool = Field(False, description="adopt partially matching stored prefixes")
    adopter_mode: AdoptMode = Field(
        AdoptMode.CLONE, description="clone (pin shared blocks) or trim (cut the stored entry)"
    )
    adopter_min_prefix_tokens: int = Field(
        0, ge=0, le=1_048_576, description="smallest partial prefix worth adopting"
    )
    adopter_trim_keep_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="trim mode: refuse a cut that keeps less than this share of the entry",
    )
    rapid_block_tokens: int = Field(
        256, ge=1, le=1_048_576,
        description="rapid-mlx (whole-entry cache): tokens per published step of an entry",
    )
    mlxlm_block_tokens: int = Field(
        256, ge=1, le=1_048_576,
        description="mlx-lm server: tokens per adoption block (boundary snapshots fall on its multiples)",
    )
    mlxlm_snapshot_bytes: int = Field(
        1 << 30, ge=0,
        description="mlx-lm server: bytes of boundary state kept for non-trimmable layers (0 = none)",
    )
    plugins: str = Field("", description="comma list: load only these plugin entry points")
    disable_plugins: str = Field("", description="comma list: never load these plugin entry points")
    control_socket: str = Field(
        "", description="unix socket for status/budget; unset = a per-user runtime path"
    )
    models: dict[str, ModelSettings] = Field(
        default_factory=dict,
        description='JSON keyed by model id, e.g. {"org/model-1.5B": {"enabled": true}}',
    )

    @field_validator("budget_pct")
    @classmethod
    def _check_budget_pct(cls, value: float) -> float:
        return validate_budget_pct(value)

    @field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip()
            return json.loads(value) if value else {}
        return value

    def for_model(self, model_id: str) -> ModelSettings:
        """The model's own entry, or the default (not opted in)."""
        return self.models.get(model_id, ModelSettings())

    def slice_tokens_for(self, model_id: str, host_prefill_step: int) -> int:
        own = self.for_model(model_id).slice_tokens
        return own or self.slice_tokens or host_prefill_step

    def idle_steps_for(self, model_id: str) -> int:
        return self.for_model(model_id).idle_steps or self.idle_steps

    @property
    def plugin_allow_list(self) -> frozenset[str]:
        return _names(self.plugins)

    @property
    def plugin_block_list(self) -> frozenset[str]:
        return _names(self.disable_plugins)


def _names(text: str) -> frozenset[str]:
    return frozenset(part.strip() for part in text.split(",") if part.strip())


class SettingsError(ValueError):
    """One or more environment variables are invalid."""


def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def _allowed(field: str) -> str:
    info = RecoverySettings.model_fields.get(field)
    if info is None:
        return ""
    bounds = []
    for meta in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                bounds.append(f"{sign} {getattr(meta, attr)}")
    annotation = info.annotation
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        bounds.append("one of " + ", ".join(m.value for m in annotation))
    return " and ".join(bounds)


def load_settings() -> RecoverySettings:
    """Read and validate every setting from the environment.

    Raises one :class:`SettingsError` that lists every bad variable.
    """
    _check_models_json()
    try:
        settings = RecoverySettings()
    except PydanticSettingsError as exc:
        # pydantic-settings decodes JSON-valued variables before validation.
        raise SettingsError(f"{env_name('models')}: not valid JSON ({exc.__cause__ or exc})") from None
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from None
    except RecursionError:
        raise SettingsError(_too_deep()) from None
    _warn_unknown_variables()
    return settings


def known_variables() -> frozenset[str]:
    """Every ``MLX_RECOVERY_*`` name this package reads."""
    fields = {env_name(name) for name in RecoverySettings.model_fields}
    return frozenset(fields | {OPENBLAS_VARIABLE, OPENBLAS_REEXEC_VARIABLE})


# Names already warned about: every plugin loads the settings, the warning is said once.
_warned: set[str] = set()


def _warn_unknown_variables() -> None:
    """A misspelt variable would be ignored without a word: say so, with the closest name."""
    known = known_variables()
    for name in sorted(k.upper() for k in os.environ if k.upper().startswith(ENV_PREFIX)):
        if name not in known and name not in _warned:
            _warned.add(name)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            log.warning("mlx-recovery: %s is not a setting and is ignored%s", name, hint)


def repeated_keys(pairs: list[tuple[str, Any]]) -> list[str]:
    """The keys that occur more than once among ``pairs``, sorted (linear in their count)."""
    counts = Counter(k for k, _ in pairs)
    return sorted(k for k, n in counts.items() if n > 1)


def _too_deep() -> str:
    return f"{env_name('models')}: nested too deeply to read (it is an object of model id -> object of settings)"


def _check_models_json() -> None:
    """Checks pydantic cannot make on ``MLX_RECOVERY_MODELS``: JSON objects keep the last
    of two equal keys, which for model opt-ins hides a typo; ``null`` or a list would
    quietly mean "no models"; nesting deep enough to exhaust the parser's recursion."""
    name = env_name("models")
    raw = next((v for k, v in os.environ.items() if k.upper() == name), "").strip()
    if not raw:
        return

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        repeated = repeated_keys(pairs)
        if repeated:
            raise SettingsError(f"{name}: duplicate keys {', '.join(map(repr, repeated))}")
        return dict(pairs)

    try:
        value = json.loads(raw, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError:
        return  # reported as invalid JSON by the settings themselves
    except RecursionError:
        raise SettingsError(_too_deep()) from None
    if not isinstance(value, dict):
        raise SettingsError(
            f"{name}: must be a JSON object keyed by model id, such as "
            f'{{"org/model": {{"enabled": true}}}}; got {type(value).__name__ if value is not None else "null"}'
        )


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        field = loc[0] if loc else "?"
        where = env_name(field)
        if field == "models" and len(loc) > 1:
            where += " [" + "].[".join(loc[1:]) + "]"
        allowed = _allowed(field) if len(loc) == 1 else ""
        hint = f" (allowed: {allowed})" if allowed else ""
        lines.append(f"{where}: {err['msg']}{hint}; got {err.get('input')!r}")
    return "invalid settings:\n  " + "\n  ".join(lines)


@dataclass(slots=True, frozen=True)
class EffectiveSetting:
    variable: str
    value: Any
    source: str  # "environment" or "default"
    description: str


def describe_settings(settings: RecoverySettings) -> list[EffectiveSetting]:
    """Every setting's effective value and where it came from."""
    env = {k.upper() for k in os.environ}
    rows = []
    for name, info in RecoverySettings.model_fields.items():
        value = getattr(settings, name)
        if isinstance(value, Enum):
            value = value.value
        if name == "models":
            value = {k: v.model_dump(exclude_none=True) for k, v in value.items()}
        source = "environment" if env_name(name) in env else "default"
        rows.append(EffectiveSetting(env_name(name), value, source, info.description or ""))
    return rows
