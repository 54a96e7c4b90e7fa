"""User-facing errors: bad configuration, bad input files, bad placements.

Commands catch ``UserError`` and print one line (no traceback unless ``--v=debug``), exit 2.
Library code raises a subclass whose message names the field or file, the value and the rule.
"""


class UserError(Exception):
    """An error caused by the user's input, reported as one line with exit code 2."""

    exit_code = 2


class ConfigError(UserError):
    """An invalid configuration value, key, flag or config file."""


class InputFileError(UserError):
    """A load file, trace, placement or weight file that cannot be used."""


class LayoutError(UserError):
    """A shared-memory object whose size, magic or version does not match this build."""


class WorkerFault(RuntimeError):
    """A worker reported an error, answered the wrong step, went silent, or died (the engine's
    step fails; with elastic EP the recovery may take over, ``elastic/recovery.py``).
    ``output``: the output frame that caused it when it was read from its ring, else None."""

    def __init__(self, message: str = "", output=None):
        super().__init__(message)
        self.output = output
