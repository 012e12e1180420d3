"""``mlx-recovery bench policy``: the publish policy's verdicts against the truth, cell by
cell over target shapes, contexts and machine load, on the real oMLX scheduler in process.
"""
