"""Tools above the runtime: deterministic tiny models, the demo and the benchmark.

They use the runtime library like any user does; nothing in the runtime imports them, so a
serving process never loads the benchmark or the tiny-model builders.
"""
