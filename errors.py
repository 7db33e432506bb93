"""The one exception type for failures a user can cause, with the exit code the CLI returns.

Messages name the file or field, the constraint that failed, and the fix, in one line.
"""

from __future__ import annotations

# Exit codes documented in README.md; CI pipelines branch on them.
EXIT_BAD_INPUT = 2
EXIT_UNSUPPORTED = 3
EXIT_ACCURACY_GATE = 4
EXIT_OUT_OF_MEMORY = 5
EXIT_INTERNAL = 70


class LlmcError(Exception):
    """A failure caused by input the user controls (files, flags, artifacts)."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UnsupportedError(LlmcError):
    """The request is well formed but this version of llmc or this target cannot do it."""

    exit_code = EXIT_UNSUPPORTED
