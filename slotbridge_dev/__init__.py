"""Development tooling of slotbridge: the bootstrap, the local stack, the demo, the
failover drill and a synthetic change producer.

Not part of the slotbridge distribution (pyproject.toml ships ``services`` and
``spark_consumers`` only), so neither the wheel nor the images carry it, and no product
module imports it (tests/unit/test_layering.py). The bootstrap puts the checkout on the
development virtualenv's path, where ``slotbridge stack`` and ``slotbridge demo`` find it.
"""
