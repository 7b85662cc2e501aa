"""Errors raylm reports to the user as one line, with no traceback."""


class ConfigError(ValueError):
    """Bad input found before any actor starts: a flag, a file, a layout, a model.

    The CLI prints ``raylm: error: <message>`` and exits with status 2.
    """


class TrainingFailed(RuntimeError):
    """The run could not finish: more failures than ``--max_failures`` allows."""
