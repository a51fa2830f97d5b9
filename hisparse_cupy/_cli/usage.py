"""The command line's exit statuses, its usage error, the checks of an output path that run
before any work (so that a bad ``--json`` path is refused at once, not after the run), and
where ``--json`` sends the text.

Imports nothing of the package: the demo's configuration (NumPy- and CuPy-free) raises
:class:`UsageError` too.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

OK = 0  # the command did what it was asked, and every check it ran passed
FAILED = 1  # a check, a self-check or a benchmark ran and found a failure
USAGE = 2  # an unknown option or command, a bad value, a bad output path, a size that cannot fit
UNAVAILABLE = 3  # this machine or installation lacks what the command needs (a GPU, a checkout)
BROKEN_PIPE = 141  # stdout was closed early (`... | head`): 128 + SIGPIPE, as a shell reports it

EXIT_STATUSES = f"""exit status (every command):
  {OK}    success
  {FAILED}    a check, the demo's self-check or a benchmark failed
  {USAGE}    usage error: a bad option, value or output path (the message names it)
  {UNAVAILABLE}    this machine or installation lacks what the command needs (a GPU, a checkout)
  {BROKEN_PIPE}  stdout was closed early (e.g. piped into head): stopped quietly"""


class UsageError(SystemExit):
    """A bad command line, in one line that names the option. The command line prints it on
    stderr and exits with status 2; anywhere else it ends the program like ``SystemExit(msg)``
    (the message on stderr, status 1)."""


def output_file(prog: str, option: str, path: str) -> None:
    """:class:`UsageError` unless ``path`` (an ``option`` of command ``prog``) can be written
    as a file: its folder exists and is writable, and it is not itself a folder."""
    p = Path(path)
    where = f"{prog}: {option} {path}"
    if p.is_dir():
        raise UsageError(f"{where}: is a folder; give a file name")
    parent = p.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise UsageError(f"{where}: the folder {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{where}: not writable")


def output_dir(prog: str, option: str, path: str) -> None:
    """:class:`UsageError` unless ``path`` is a writable folder or can be made as one (its
    nearest existing ancestor is a writable folder)."""
    p = Path(path)
    where = f"{prog}: {option} {path}"
    if p.exists() and not p.is_dir():
        raise UsageError(f"{where}: is a file, not a folder")
    up = p
    while not up.exists():
        up = up.parent
    if not up.is_dir():
        raise UsageError(f"{where}: {up} is a file, not a folder")
    if not os.access(up, os.W_OK | os.X_OK):
        raise UsageError(f"{where}: {up} is not writable")


@contextlib.contextmanager
def stdout_to_stderr():
    """Meanwhile whatever Python or a C library writes to stdout goes to stderr: ``--json``
    keeps stdout for its one object."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no file descriptor 1: Python's own prints are redirected still
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def emit(doc: dict) -> None:
    """``--json``: the one object on stdout."""
    print(json.dumps(doc, indent=1))
