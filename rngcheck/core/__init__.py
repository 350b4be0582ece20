"""The records and readings every check builds on: which ops are random, generator identity and
state digests, events, findings, call stacks, seeding call sites, expectations and configuration,
and the private dispatch mode that intercepts ops. Nothing here knows a check, the mode or the
console."""
