"""The cross-rank check: a random draw must agree across exactly the ranks over which the state
it feeds is replicated.

``startup.py`` starts it (collectively); ``checker.py`` takes this rank's random ops and runs the
rounds of ``protocol.py`` over ``exchange.py``'s side groups. Each op's verdict comes from the
judge (``scopes.py``), from the scopes the integrations open (``integrations/``, installed by
``hooks.py`` into ``program.py``) and what was learnt of the generators (``generators.py``);
``window.py`` turns it into a row. A round that does not agree goes to ``divergence.py``:
``localise.py`` finds the first divergent op, ``findings.py`` describes it in ``explain.py``'s
words. ``replicated.py`` settles parameter initialisations; ``step_level.py`` is the step
level's part; ``groups.py`` resolves who must agree; ``board.py`` leaves notes on the c10d store.
Nothing is imported here: the documentation reads ``integrations/`` without torch.
"""
