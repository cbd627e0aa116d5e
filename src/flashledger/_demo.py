"""The command line of ``python -m flashledger.<module>``: a module's demo, which takes no
options (the ``flashledger`` command takes them), so that an option given to it is refused,
not silently dropped."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from ._text import shown


def run_demo(
    module: str,
    demo: Callable[[], None],
    command: str | None = None,
    argv: Sequence[str] | None = None,
) -> None:
    """Print ``demo()`` (its docstring's first line says what it shows) once ``argv``
    (default: ``sys.argv[1:]``) is found empty; any argument exits with status 2 and a line
    that says where the options are (``flashledger COMMAND`` where ``command`` is given)."""
    where = (
        f"flashledger {command} takes options (flashledger {command} --help)"
        if command
        else "the flashledger command takes options (flashledger --help)"
    )
    what = (demo.__doc__ or "a demo.").strip().splitlines()[0].rstrip(".")
    parser = argparse.ArgumentParser(
        prog=f"python -m flashledger.{module}",
        description=f"Print {what[:1].lower()}{what[1:]}. The demo takes no options; {where}.",
    )
    _, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(f"the demo takes no options, got {shown(' '.join(extra))}; {where}")
    try:
        demo()
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as a filter
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
