"""Hugging Face's transformers: ``generate()`` (``GenerationMixin``), and its own
``IterableDatasetShard``, which its Trainer no longer uses but scripts may.

``generate()`` on the module a known data-parallel wrapper wraps (``model.module.generate``,
accelerate's ``unwrap_model``: reinforcement-learning rollouts) samples for this rank's own
inputs, as the wrapper's forward computes on its own batch. On a model no wrapper wraps
(evaluation with ``predict_with_generate``, a frozen reference model) it samples for the inputs
it is given too, but whether every rank samples, and from what state, is still a claim about the
program: the call is compared by its first random op. A model with DTensor parameters is neither:
its tensor-parallel peers must sample alike, op by op."""

from __future__ import annotations

from ..verdict import Reason
from . import register
from .common import STREAM_ADVICE, STREAM_WHAT
from .records import Frames, Generate, Integration, Role

register(
    Integration(
        name="transformers",
        library="transformers",
        hooks=(
            Generate(
                module="transformers.generation.utils",
                attribute="GenerationMixin.generate",
                label="generate()",
            ),
            Frames(
                module="transformers.trainer_pt_utils",
                attribute="IterableDatasetShard.__iter__",
                label="transformers' IterableDatasetShard",
                role=Role.ORDER,
                scope=Reason.ORDER,
                what=STREAM_WHAT,
                advice=STREAM_ADVICE,
            ),
        ),
    )
)
