"""The cross-rank check: ranks that must agree draw from the same generator states, op for op.

``startup.py`` starts it (collectively); ``checker.py`` takes this rank's random ops and runs the
rounds of ``protocol.py`` over ``exchange.py``'s side groups; ``localise.py`` finds the first
divergent op in the gathered rows and ``findings.py`` describes it; ``data_parallel.py`` knows
the wrappers whose ranks see different data; ``groups.py`` resolves who must agree; ``board.py``
leaves notes on the c10d store when something goes wrong.
"""

from .checker import RankChecker
from .startup import start

__all__ = ["RankChecker", "start"]
