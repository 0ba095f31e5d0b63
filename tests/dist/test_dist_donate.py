"""CompileOptions.donate: a donated gradient is reduced in place; results are unchanged.

Donation is a permission, not a promise: with the native gloo all_reduce (in place) the gradient
buffer itself receives the sum, which is what this test checks on torch.distributed. Over shared
memory AR_C's kernel reads the sum where it was reduced (no copy at all), so the gradient is left
as it was: only the result is checked there.
"""

import pytest
from support import dist_workers

from coconet.runtime import CommOptions, spawn


@pytest.mark.timeout(120)
def test_a_donated_gradient_is_reduced_in_place_with_the_same_result():
    rows = spawn(
        dist_workers.run_donated,
        2,
        9,
        options=CommOptions(timeout=30, algorithms="native", transport="torch.distributed"),
        timeout=100,
    )
    for row in rows:
        assert row == {"equal": True, "g_reduced_in_place": True, "g_changed": True}


@pytest.mark.timeout(120)
def test_over_shared_memory_a_donated_gradient_gives_the_same_result():
    for row in spawn(dist_workers.run_donated, 2, 9, options=CommOptions(timeout=30), timeout=100):
        assert row["equal"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("numel", [1000, 3 << 20])  # one round and two, the in-place form
def test_a_donated_input_in_the_step_buffer_is_the_output_uncopied(numel):
    for row in spawn(dist_workers.run_donated_output, 2, numel, options=CommOptions(timeout=30),
                     timeout=100):  # fmt: skip
        assert all(row.values()), row
