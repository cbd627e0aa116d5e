"""Consoles, titled tables, progress bars and argument types shared by the command line.

Both follow the terminal: colour only on a terminal (``NO_COLOR`` turns it off),
plain text when output goes to a pipe or a file, and progress bars only when
standard error is a terminal, so captured output stays exactly comparable.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ._limits import MAX_SIZE

if TYPE_CHECKING:
    from rich.console import Console, Group

__all__ = [
    "figure_png",
    "int_arg",
    "join_dash_values",
    "make_console",
    "numeric_cell",
    "output_problem",
    "progress",
    "titled_table",
    "write_file",
]

SHORT_CELL = 24
"""Text cells up to this long are labels a table never splits (``titled_table``)."""
PLAIN_WIDTH = 160
"""Column width used when writing to a pipe or a file (tables are never wrapped there)."""


def int_arg(lo: int, hi: int = MAX_SIZE) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``lo..hi`` (default top: the int32 index range)."""

    def conv(text: str) -> int:
        allowed = f"an integer >= {lo}" if hi == MAX_SIZE else f"an integer in {lo}..{hi}"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected {allowed}, got {value}")
        if value > hi:
            raise argparse.ArgumentTypeError(f"expected an integer in {lo}..{hi}, got {value}")
        return value

    return conv


def join_dash_values(argv: list[str], options: Sequence[str]) -> list[str]:
    """``OPT VALUE`` as ``OPT=VALUE`` for ``options`` whose value may start with '-'.

    argparse takes ``-1,2`` for an option name; ``--scores -1,2`` then fails.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in options and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def output_problem(path: str | Path) -> str:
    """Why a file cannot be written at ``path`` (``""`` when it can): checked before long work.

    Tries what the write will do, without changing anything: an existing file is opened for
    appending (nothing written), a new one is created and removed again. A device that
    refuses data only when it is written (``/dev/full``) passes; the write itself is
    checked (``write_file``).
    """
    if not str(path).strip():
        return "the path is empty"
    target = Path(path)
    if target.is_dir():
        return "is a directory"
    if target.parent.exists() and not target.parent.is_dir():
        return f"{target.parent} is a file, not a directory"
    if not target.parent.is_dir():
        return "its directory does not exist"
    try:
        if target.exists():
            with open(target, "ab"):
                pass
        else:
            with open(target, "xb"):
                pass
            target.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


def write_file(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and make sure it arrived: an ``OSError`` names the path (a
    full disk, ``/dev/full``, a file system that went read-only)."""
    try:
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from None


def figure_png(fig: object) -> bytes:
    """A matplotlib figure as PNG bytes (matplotlib does not report a failed write to a file)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)  # type: ignore[attr-defined]
    return buf.getvalue()


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


@functools.cache
def _wide_console() -> type[Console]:
    from rich.console import Console

    class WideConsole(Console):
        """A console that prints a table no narrower than its cells need: wider than the
        terminal it runs past the edge (the terminal wraps the line) rather than split a
        number or cut it off."""

        def print(self, *objects: Any, **kwargs: Any) -> None:  # type: ignore[override]
            if len(objects) == 1 and not isinstance(objects[0], str) and "width" not in kwargs:
                unbounded = self.options.update(max_width=1 << 20)
                need = self.measure(objects[0], options=unbounded).minimum
                if need > self.width:
                    kwargs.update(width=need, crop=False)
            super().print(*objects, **kwargs)

    return WideConsole


def make_console(file: TextIO | None = None) -> Console:
    """A rich console on ``file`` (default: the current ``sys.stdout``).

    On a terminal it uses colour (unless ``NO_COLOR`` is set) and the terminal's
    width; elsewhere it writes plain text ``PLAIN_WIDTH`` columns wide
    (``COLUMNS`` overrides the width; ``FORCE_COLOR`` forces colour). Strings are printed as they are (no
    console markup), so labels like ``[b0 h1 3]`` survive. A table is printed no narrower
    than its cells need (``_wide_console``).
    """
    stream = sys.stdout if file is None else file
    terminal = _is_terminal(stream)
    width = None if terminal else int(os.environ.get("COLUMNS", PLAIN_WIDTH))
    return _wide_console()(
        file=stream,
        width=width,
        no_color="NO_COLOR" in os.environ,
        force_terminal=True if terminal else None,  # None: rich decides (FORCE_COLOR)
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=False,
    )


@contextmanager
def progress(
    description: str, *, total: float | None, enabled: bool | None = None
) -> Iterator[Callable[[float], None]]:
    """Show a transient progress bar on standard error; yields ``advance(amount)``.

    ``enabled=None`` (default) shows the bar only when standard error is a
    terminal; with ``False`` the returned ``advance`` does nothing.
    """
    show = _is_terminal(sys.stderr) if enabled is None else enabled
    if not show:
        yield _no_progress
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f}"),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    )
    with bar:
        task = bar.add_task(description, total=total)

        def advance(amount: float = 1.0) -> None:
            bar.advance(task, amount)

        yield advance


def _no_progress(amount: float = 1.0) -> None:
    """``advance`` when no bar is shown."""


def numeric_cell(cell: str) -> bool:
    """Numbers (``1,234``, ``-inf``, ``1e-05``) and blanks (``""``, ``-``) are right-aligned."""
    if cell in ("", "-"):
        return True
    try:
        float(cell.replace(",", ""))
    except ValueError:
        return False
    return True


def titled_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> Group:
    """A rich table under its title, which is its own line (never wrapped to the table's width).

    Columns whose every cell is ``numeric_cell`` are right-aligned. Numbers and labels of up
    to ``SHORT_CELL`` characters stay on one line (``make_console``'s console runs a table
    past a narrow terminal's edge rather than split one); longer text and the headers wrap
    at their spaces.
    """
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD)
    for i, h in enumerate(header):
        numeric = all(numeric_cell(r[i]) for r in rows)
        longest = max((len(r[i]) for r in rows), default=0)
        words = [len(w) for r in rows for w in r[i].split()] + [len(w) for w in h.split()]
        # numbers and short labels never split; longer text and headers wrap at spaces
        whole = max([longest if numeric or longest <= SHORT_CELL else 0, *words])
        table.add_column(
            h, justify="right" if numeric else "left", overflow="fold", min_width=whole
        )
    for r in rows:
        table.add_row(*r)
    return Group(Text(title, style="bold"), table)
