"""Errors that the CLI turns into one-line messages and exit codes."""


class OptfuseError(Exception):
    """Base class. `exit_code` is what the CLI returns."""

    exit_code = 1


class InputError(OptfuseError):
    """Bad user input: missing or unreadable model, invalid recipe, unknown option (exit 2)."""

    exit_code = 2


class VerificationError(OptfuseError):
    """The candidate model does not match the reference within tolerance (exit 1)."""

    exit_code = 1


class BuildError(OptfuseError):
    """An engine could not be built as asked, e.g. a fused node did not become a plugin (exit 2)."""

    exit_code = 2
