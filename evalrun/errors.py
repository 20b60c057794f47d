"""Named errors. Each one carries a single line that says what was wrong and what to do.

The CLI maps every `EvalrunError` to one line on stderr and exit code 2.
"""


class EvalrunError(Exception):
    """Base class: the command could not do its job (exit 2)."""


class ConfigError(EvalrunError):
    """A configuration key or value is invalid or unavailable."""


class ModelError(EvalrunError):
    """A model reference cannot be resolved or loaded."""


class PromptError(EvalrunError):
    """A prompt set file is missing or malformed."""


class StoreError(EvalrunError):
    """The store cannot be opened, written, or does not hold what was asked."""


class DeviceError(EvalrunError):
    """The requested device is not available on this machine."""


class GoldenError(EvalrunError):
    """A golden file is missing, damaged, edited, or cannot be compared."""
