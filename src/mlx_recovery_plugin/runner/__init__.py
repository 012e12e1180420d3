"""The plugin's own MLX model runner for recovery slices (see :mod:`.runner`)."""

from .runner import RECOVERY_ORIGIN, LiveState, SliceOutcome, SliceRunner

__all__ = ["RECOVERY_ORIGIN", "LiveState", "SliceOutcome", "SliceRunner"]
