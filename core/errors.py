"""The one exception type for user errors.

Its message names the bad value and what to do. The CLI prints it as one line without a traceback and exits
with 2 for usage errors (a bad flag value) and 1 for failures (bad input files, a full disk).
"""


class EngineError(Exception):
    """A user error; `usage=True` marks a bad command-line value (exit status 2)."""

    def __init__(self, message: str, *, usage: bool = False):
        super().__init__(message)
        self.usage = usage

    @property
    def exit_code(self) -> int:
        return 2 if self.usage else 1
