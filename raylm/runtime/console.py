"""What a person sees of a run: raylm's log lines in a Python program that set up no
logging (as the command line shows them), at --log_level, and Ray's rank-line prefixes
without colour codes when the output is not a terminal."""

from __future__ import annotations

import contextlib
import logging
import os
import sys

from raylm.config.flags import LOG_LEVELS
from raylm.errors import ConfigError

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def _configured() -> bool:
    """Whether the program set up logging itself (a handler on the root or raylm logger)."""
    return bool(logging.getLogger().handlers or logging.getLogger("raylm").handlers)


@contextlib.contextmanager
def console(log_level: str = "passive"):
    """For one train() call: raylm's INFO lines on stderr unless the program set up
    logging itself ("passive" leaves that setup alone; another level sets raylm's), and
    plain rank prefixes (RAY_COLOR_PREFIX=0) when stderr is not a terminal."""
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"--log_level {log_level!r}: one of {', '.join(LOG_LEVELS)}")
    log = logging.getLogger("raylm")
    level, handler = log.level, None
    if log_level != "passive":
        log.setLevel(log_level.upper())
    if not _configured():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        log.addHandler(handler)
        if log_level == "passive":
            log.setLevel(logging.INFO)
    uncoloured = not sys.stderr.isatty() and "RAY_COLOR_PREFIX" not in os.environ
    if uncoloured:  # Ray reads it each time it prints a rank's line in this process
        os.environ["RAY_COLOR_PREFIX"] = "0"
    try:
        yield
    finally:
        if uncoloured:
            os.environ.pop("RAY_COLOR_PREFIX", None)
        if handler is not None:
            log.removeHandler(handler)
        log.setLevel(level)
