"""The host versions this package supports, in one place, and the check that enforces them.

``pyproject.toml`` repeats :data:`SUPPORTED_SGLANG` as the ``sglang`` requirement; a test
checks that the two agree.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from dsv4_backend.errors import ConfigError

#: The sglang releases whose internals (attention registry, draft factory, CLI choices,
#: model overrides) this package's registration was written against.
SUPPORTED_SGLANG = ">=0.5.23,<0.5.24"


def installed_version(distribution: str) -> str | None:
    """Return the installed version of ``distribution``, or ``None`` when it is absent.

    Reads package metadata only; nothing is imported.
    """
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def check_sglang_version(version: str) -> None:
    """Refuse an sglang release outside :data:`SUPPORTED_SGLANG`.

    Post-releases of a supported release (``0.5.23.post1``) are accepted.

    Raises
    ------
    ConfigError
        Naming the version found, the supported range and the two ways out.
    """
    try:
        supported = Version(version) in SpecifierSet(SUPPORTED_SGLANG, prereleases=True)
    except InvalidVersion:
        supported = False
    if not supported:
        raise ConfigError(
            f"dsv4_backend supports sglang {SUPPORTED_SGLANG}, found sglang {version}. "
            "Install a supported sglang, or keep this plugin from loading by setting "
            "SGLANG_PLUGINS to the other plugins' names (or uninstalling dsv4-backend)."
        )
