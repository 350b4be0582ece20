"""The parts of a running mode that ``mode.py`` composes.

``recorder.py`` records random ops (the hot path: generator states around each draw, the event,
and handing it to the checks); ``steps.py`` is the one optimizer-step hook, the lead optimizer
and ``level="step"``'s switching between op level and step level; ``closing.py`` brings the
report's counters, metadata and closing notes up to date, and writes the report and trace at
exit. The mode builds each part, hands it the checks it started (a part keeps its own references:
no hop through the mode per random op), and owns the configuration, the report and the
lifecycle. Like the mode, these import ``core/``, the checks and ``output/``; nothing imports them
but ``mode.py``, and they never import the mode.
"""
