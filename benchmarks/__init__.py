"""rngcheck's benchmark suite: step-time overhead, memory and the cross-rank exchange.

``python -m benchmarks`` runs all of it and prints the markdown report that docs/performance.md
shows; each module also runs on its own (see its docstring). ``--quick`` everywhere.
"""
