"""Where findings go and how they are read: the report, the finding sink, the renderer (rich and
plain text) and the random-op trace for ``rngcheck diff``."""
