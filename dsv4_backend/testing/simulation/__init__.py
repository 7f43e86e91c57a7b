"""A host-agnostic serving simulator: requests in a paged pool, batches of every kind, and the
reference rows each output must equal. Tests, the A/B tool and the sglang loop build on it."""

from dsv4_backend.self_check.requests import PagedRequestPool
from dsv4_backend.testing.simulation.dspark import DSparkDraft
from dsv4_backend.testing.simulation.model import RandomModel

__all__ = ["DSparkDraft", "PagedRequestPool", "RandomModel"]
