"""Every registered backend against the shared conformance suite (see kvbridge.testing.conformance)."""

from kvbridge.testing.conformance import *  # noqa: F403
