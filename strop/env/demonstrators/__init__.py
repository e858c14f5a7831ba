"""Demonstrators: scripted policies that play tasks through the real harness for the SFT warm start
(`scripted` is their base, `imperfect` plays a reference solution with real traces' mistakes,
`chain` works the chain suite from its own window; `runs` collects their demonstrations)."""
