"""How big the randomized tests run: quick by default, full size with ``DSV4_STRESS=1``.

The default suite must fit in 5 minutes of CPU on 2 cores, so its hypothesis examples and random
batches are small; ``DSV4_STRESS=1 scripts/test.sh`` (README, "Set-up") runs the long variants:
more examples, larger batches, more serving-trace seeds.
"""

import os

#: True under ``DSV4_STRESS=1`` (any value but empty and ``0``).
STRESS = os.environ.get("DSV4_STRESS", "") not in ("", "0")


def sized(quick: int, stress: int) -> int:
    """``quick`` in the default suite, ``stress`` under ``DSV4_STRESS=1``."""
    return stress if STRESS else quick
