"""Named errors and the exit-code contract. Each error carries a single line that says what was
wrong and what to do.

Exit codes, everywhere:
  0  success (identical, drift)
  1  a check failed: `changed`, or `drift` under --strict, or a `bench --fail-on` regression; nothing else
  2  the command could not do its job: bad input, missing or damaged file (a store `store check` finds
     problems in), incomparable, impossible config (every `EvalrunError`)
  3  evalrun itself failed: an unexpected exception; one line on stderr names the file holding the
     traceback. CI must never read a crash as "changed".
"""

EXIT_OK = 0
EXIT_CHANGED = 1
EXIT_UNUSABLE = 2
EXIT_INTERNAL = 3


class EvalrunError(Exception):
    """Base class: the command could not do its job (exit 2)."""


class ConfigError(EvalrunError):
    """A configuration key or value is invalid or unavailable."""


class FallbackError(ConfigError):
    """Under --strict-config, the requested execution mode fell back to another."""


class ModelError(EvalrunError):
    """A model reference cannot be resolved or loaded."""


class UnsupportedModelError(ModelError):
    """The model's config asks for something evalrun's engine does not compute (engine.model_support)."""


class PromptError(EvalrunError):
    """A prompt set file is missing or malformed."""


class StoreError(EvalrunError):
    """The store cannot be opened, written, or does not hold what was asked."""


class DeviceError(EvalrunError):
    """The requested device is not available on this machine."""


class GoldenError(EvalrunError):
    """A golden file is missing, damaged, edited, or cannot be compared."""


class OutputError(EvalrunError):
    """An output path (report, plot, golden folder) cannot be written."""


class BisectError(EvalrunError):
    """GOOD and BAD cannot be bisected: a bad SPEC, a GOOD that fails the predicate, a missing golden."""


class ServerError(EvalrunError):
    """An OpenAI-compatible server did not answer, answered with an error, or answered malformed."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status when the server refused the request


class Terminated(KeyboardInterrupt):
    """SIGTERM (a cancelled CI job, a scheduler's stop): the command stops as on Ctrl-C, exit 2, and a run
    being made is stored as interrupted."""
