"""Canonical state recovery: re-read a sparsely served prompt range densely while the
whole process is idle, and publish it as ordinary prefix state through the host's cache.

Process-wide pieces: :mod:`.registry` (arrivals), :mod:`.budget` (wall-time share and the
execution claim), :mod:`.runnable` (may a slice run now, and if not, why) and
:mod:`.control` (the owner-only local control channel). Per engine, :mod:`.service` runs
the slice loop over :mod:`.jobs` (what is owed), :mod:`.live` (the job being prefilled),
:mod:`.slice_size`, :mod:`.judge` (the publish policy), :mod:`.publication` and
:mod:`.ledger` (references given back); :mod:`.outcomes` names refusals and faults.
"""
