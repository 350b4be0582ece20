"""The whole suite, as the markdown docs/performance.md shows.

.venv/bin/python -m benchmarks                      # a few minutes on 2 cores
.venv/bin/python -m benchmarks --quick              # seconds: the smoke test's configuration
.venv/bin/python -m benchmarks --json results.json  # also the raw numbers
.venv/bin/python -m benchmarks --skip ranks,memory  # one process only
.venv/bin/python -m benchmarks --skip single,compiled,vit,ranks,memory,gpu  # GPT-2 only
.venv/bin/python -m benchmarks.vit                  # the timm ViT section only (or why not)
.venv/bin/python -m benchmarks.gpu                  # the GPU section only (skipped without CUDA)

One question, many rounds (a shared machine moves a 15-round ratio by several percent):
.venv/bin/python -m benchmarks --skip single,compiled,gpt2,vit,memory,gpu --sizes 32 --rounds 100 \
    --modes plain,rngcheck,rngcheck-step
"""

import sys

from . import compiled, distributed, gpt2, gpu, memory, overhead, vit
from .common import cli

sys.exit(
    cli(
        __doc__,
        {
            "single": overhead.section,
            "compiled": compiled.section,
            "gpt2": gpt2.section,
            "vit": vit.section,  # a timm ViT from a tiny config; one line without timm
            "ranks": distributed.section,
            "memory": memory.section,
            "gpu": gpu.section,  # GPT-2 small's size on a CUDA GPU; one line without one
        },
    )
)
