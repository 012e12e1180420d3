"""Canonical state recovery: re-read a sparsely served prompt range densely while the
whole process is idle, and publish it as ordinary prefix state through the host's cache.

Process-wide pieces: :mod:`.registry` (arrivals), :mod:`.budget` (wall-time share and the
execution claim), :mod:`.gate` (may a slice run now, and if not, why) and :mod:`.control`
(the owner-only local control channel).
"""
