"""Helpers shared by the tests (tests/unit, tests/dist), not tests themselves: the examples as
modules (``examples_loader``), the tolerance table (``tolerances``), a world of one running a
generated ``step()`` (``generated``), and the functions that spawned ranks run
(``dist_workers``, ``dist_programs``, ``optim_workers``, ``safety_workers``, ``shm_workers``,
``sigint_workers``, ``tune_workers``).

``pythonpath = ["tests"]`` in pyproject.toml puts this package on ``sys.path`` as ``support``;
the ranks that ``coconet.runtime.spawn`` starts inherit that path, so a worker pickled as
``support.dist_workers.<name>`` is found again in the child.
"""
