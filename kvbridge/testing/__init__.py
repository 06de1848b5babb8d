"""Test support shipped with kvbridge: a miniature engine, and the conformance suite every backend passes.

- :class:`MiniEngine` drives any backend through the connector contract exactly as the vLLM adapter
  does (lookup, allocate, plan, start/save/finish, poll, finish), with a real paged KV cache whose
  "computed" contents are a deterministic function of the tokens, so any process can tell whether
  the bytes that arrived are the bytes that left.
- :mod:`kvbridge.testing.conformance` holds the suite; :mod:`kvbridge.testing.targets` declares
  what the built-in backends are tested as; a third-party backend joins by exposing
  ``conformance_target(tmp_path) -> Target`` in its module.
"""

from kvbridge.testing.engine import MiniEngine, PrefillResult, Target

__all__ = ["MiniEngine", "PrefillResult", "Target"]
