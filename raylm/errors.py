"""Errors raylm reports to the user as one line, with no traceback."""


class ConfigError(ValueError):
    """Bad input found before any actor starts: a flag, a file, a layout, a model.

    The CLI prints ``raylm: error: <message>`` and exits with status 2.
    """


class TrainingFailed(RuntimeError):
    """The run could not finish: more failures than ``--max_failures`` allows."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what
    a ConfigError quotes of a library's error."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
