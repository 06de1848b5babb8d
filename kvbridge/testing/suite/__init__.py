"""The conformance suite's parts; :mod:`kvbridge.testing.conformance` gathers them (import the suite from there)."""
