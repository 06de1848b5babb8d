"""The conformance suite: one set of tests that every registered backend must pass.

Use it from a test module with::

    from kvbridge.testing.conformance import *  # noqa: F403

It runs every test once per backend in the registry (built-in and entry points). A backend joins with
a target, a producer and a consumer backend sharing whatever medium they use: the built-in ones are
declared in :mod:`kvbridge.testing.targets`; a third-party backend exposes, in its module,
``conformance_target(tmp_path) -> kvbridge.testing.Target``. A backend that cannot be imported here
(missing extra) is *skipped* with the reason and the install hint; a backend without a target
*fails*. To run the suite against only some backends, select them by name (``-k fs``: each test's id names
its backend).

Faults come from the target's hooks (:class:`~kvbridge.testing.engine.Target`: ``corrupt``,
``vanish``, ``break_saves``); a test whose hook the target lacks is skipped with the target's reason.
Every test that moves KV compares the bytes that arrived with the bytes the engine computes
(:meth:`MiniEngine.expected`) or the producer's snapshot, bit for bit.

The tests live in :mod:`kvbridge.testing.suite` by subject (``transfers``, ``faults``, ``endings``); this
module gathers them, so ``pytest --pyargs kvbridge.testing.conformance`` runs the whole suite.
"""

from kvbridge.testing.suite.endings import (
    test_preempted_request_saves_finish_before_the_next_step,
    test_request_ending_before_its_load_starts_frees_at_once,
    test_request_ending_mid_load_is_held_until_the_load_is_over,
)
from kvbridge.testing.suite.faults import (
    test_corrupt_data_is_never_loaded,
    test_failing_saves_never_harm_a_request,
    test_use_after_close_raises,
    test_vanished_medium_fails_the_load_and_is_recomputed,
)
from kvbridge.testing.suite.support import conformance_backend
from kvbridge.testing.suite.transfers import (
    LAYOUTS,
    test_concurrent_requests_do_not_mix,
    test_concurrent_requests_sharing_a_prefix,
    test_layout_mismatch_is_refused,
    test_lookup_is_idempotent,
    test_miss_is_a_miss_not_an_error,
    test_partial_prefix_hit,
    test_round_trip_is_bit_exact,
    test_whole_prompt_hit_leaves_one_token_to_compute,
)

__all__ = [
    "LAYOUTS",
    "conformance_backend",
    "test_concurrent_requests_do_not_mix",
    "test_concurrent_requests_sharing_a_prefix",
    "test_corrupt_data_is_never_loaded",
    "test_failing_saves_never_harm_a_request",
    "test_layout_mismatch_is_refused",
    "test_lookup_is_idempotent",
    "test_miss_is_a_miss_not_an_error",
    "test_partial_prefix_hit",
    "test_preempted_request_saves_finish_before_the_next_step",
    "test_request_ending_before_its_load_starts_frees_at_once",
    "test_request_ending_mid_load_is_held_until_the_load_is_over",
    "test_round_trip_is_bit_exact",
    "test_use_after_close_raises",
    "test_vanished_medium_fails_the_load_and_is_recomputed",
    "test_whole_prompt_hit_leaves_one_token_to_compute",
]
