"""The package's error types: every refusal a user can reach raises one of these.

All are ``ValueError`` subclasses so hosts that catch bad input generically still do.
"""


class DSV4Error(ValueError):
    """Base class of every error this package raises on purpose."""


class ConfigError(DSV4Error):
    """A configuration this backend cannot serve; raised when the backend is built."""


class BatchError(DSV4Error):
    """A batch whose fields disagree with each other or with the configuration."""


class ContractError(DSV4Error):
    """Metadata and the forward it serves disagree (the lazy-init contract was broken).

    Raised instead of letting a kernel crash on mismatched shapes or silently read the rows of
    another batch.
    """


class MissingBackendError(DSV4Error):
    """A piece of the backend that this installation does not provide was asked for."""
