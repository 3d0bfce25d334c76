"""Benchmarks: tqstream side by side with other ways of moving RL experience between processes.

Run ``python -m pytest benchmarks`` (pytest-benchmark) or ``python -m benchmarks.report`` for the
ratio tables; ``benchmarks/README.md`` says what each system measures.
"""
