"""CompileOptions.donate: a donated gradient is reduced in place; results are unchanged.

Donation is a permission, not a promise: with the native gloo all_reduce (in place) the gradient
buffer itself receives the sum, which is what this test checks.
"""

import dist_workers
import pytest

from coconet.runtime import CommOptions, spawn


@pytest.mark.timeout(120)
def test_a_donated_gradient_is_reduced_in_place_with_the_same_result():
    rows = spawn(
        dist_workers.run_donated,
        2,
        9,
        options=CommOptions(timeout=30, algorithms="native"),
        timeout=100,
    )
    for row in rows:
        assert row == {"equal": True, "g_reduced_in_place": True, "g_changed": True}
