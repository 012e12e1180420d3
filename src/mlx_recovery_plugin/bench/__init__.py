"""Side-by-side benchmarks: variants run in one process, alternating, reported as ratios
with their spread (the machines are shared and noisy)."""
