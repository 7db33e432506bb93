"""The transformers versions llmc's builds are tested with, and the build's refusal of any other.

llmc lowers a model by tracing transformers' own classes, so transformers' version is part of every engine's
correctness: a release that moves a hybrid's cache or a layer's internals can make an engine decode wrong tokens
without any error. The range here is the one ``pyproject.toml`` declares (tests/test_transformers_versions.py holds
the two equal) and the one CI runs at both ends.
"""

from __future__ import annotations

import logging
import os

from llmc.errors import LlmcError

# Keep equal to pyproject.toml's transformers requirement.
SUPPORTED_TRANSFORMERS = ">=5.25,<5.26"
# Set to 1 to build with a transformers outside the range anyway (a warning instead of the refusal): for trying a
# new release, not for engines anyone depends on.
OVERRIDE_ENV = "LLMC_UNTESTED_TRANSFORMERS"


def installed_transformers() -> str | None:
    """The installed transformers distribution's version, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def lowest_supported() -> str:
    """The lowest transformers version the range admits (its ``>=`` bound), e.g. ``"5.25"``."""
    from packaging.specifiers import SpecifierSet

    return next(s.version for s in SpecifierSet(SUPPORTED_TRANSFORMERS) if s.operator == ">=")


def check_transformers(installed: str | None = None) -> None:
    """Refuse (exit 2) a build under a transformers version outside :data:`SUPPORTED_TRANSFORMERS`, in one line
    naming both, before any work; ``installed`` defaults to the installed distribution's version."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    installed = installed_transformers() if installed is None else installed
    fix = f"pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
    if installed is None:
        raise LlmcError(f"transformers is not installed; llmc builds trace its model classes: {fix}")
    try:
        inside = Version(installed) in SpecifierSet(SUPPORTED_TRANSFORMERS)
    except InvalidVersion:
        inside = False
    if inside:
        return
    said = (f"transformers {installed} is installed, but llmc {_llmc_version()} is tested with transformers"
            f"{SUPPORTED_TRANSFORMERS}, and its engines follow transformers' own classes")
    if os.environ.get(OVERRIDE_ENV) == "1":
        logging.getLogger("llmc").warning("%s; building anyway (%s=1): check the engine against transformers", said,
                                          OVERRIDE_ENV)
        return
    raise LlmcError(f"{said}: {fix} (or set {OVERRIDE_ENV}=1 to build with it untested)")


def _llmc_version() -> str:
    import llmc

    return llmc.__version__
