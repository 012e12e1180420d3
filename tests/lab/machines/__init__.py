"""Hypothesis state machines over the real parts: the recovery machine (two engines, the
real runner, block pool and prefix cache, injected faults) and the adopter machine (the
detached store over the refcounted pool). The tests run them derandomized, the same
cases every time; ``python tests/lab machines`` runs them wider, with fresh random
cases. Importing this package needs hypothesis (the ``test`` extra)."""
