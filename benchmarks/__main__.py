"""The whole suite, as the markdown docs/performance.md shows.

.venv/bin/python -m benchmarks                      # a few minutes on 2 cores
.venv/bin/python -m benchmarks --quick              # seconds: the smoke test's configuration
.venv/bin/python -m benchmarks --json results.json  # also the raw numbers
.venv/bin/python -m benchmarks --skip ranks,memory  # one process only
"""

import sys

from . import compiled, distributed, memory, overhead
from .common import cli

sys.exit(
    cli(
        __doc__,
        {
            "single": overhead.section,
            "compiled": compiled.section,
            "ranks": distributed.section,
            "memory": memory.section,
        },
    )
)
