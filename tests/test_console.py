"""What a Python program that calls train() sees: raylm's lines where it set up no
logging, at --log_level, its own setup left alone, and no colour codes in Ray's rank
prefixes when stderr is a file."""

import subprocess
import sys

import pytest

from raylm.errors import ConfigError
from raylm.runtime.console import console

PROGRAM = r"""
import logging, os, sys
from raylm.runtime.console import console
log = logging.getLogger("raylm")
with console("passive"):
    log.info("shown-1"); log.debug("hidden-1")
    print("prefix colour:", os.environ.get("RAY_COLOR_PREFIX"), file=sys.stderr)
print("after:", os.environ.get("RAY_COLOR_PREFIX"), file=sys.stderr)
log.info("hidden-2")
with console("warning"):
    log.info("hidden-3"); log.warning("shown-2")
with console("debug"):
    log.debug("shown-3")
logging.basicConfig(format="own %(message)s", level=logging.WARNING)
with console("passive"):
    log.info("hidden-4"); log.warning("shown-4")
"""


def test_a_program_without_logging_sees_raylms_lines_at_the_level_asked():
    err = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                         check=True, timeout=120).stderr
    for shown in ("raylm INFO shown-1", "raylm WARNING shown-2", "raylm DEBUG shown-3"):
        assert shown in err, err
    assert "hidden" not in err, err
    # stderr is a pipe: Ray's rank prefixes without colour, for the run only
    assert "prefix colour: 0" in err and "after: None" in err, err
    # a program's own logging setup is used as it is (one line, its format)
    assert [line for line in err.splitlines() if "shown-4" in line] == ["own shown-4"], err


def test_an_unknown_log_level_is_one_clear_error():
    with pytest.raises(ConfigError, match="--log_level 'loud': one of passive, debug"):
        with console("loud"):
            pass
