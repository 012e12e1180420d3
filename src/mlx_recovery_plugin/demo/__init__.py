"""The three-arm demo: sparse route off, on, and on with recovery, on one session."""
