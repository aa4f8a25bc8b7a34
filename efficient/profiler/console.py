"""Console output that fits the width it is printed at (a terminal's, else COLUMNS, else 80).

`FitTable` is a rich table laid out when it is printed: name columns (identifiers a user copies:
model, layer and metric names) are never cut or wrapped, numbers never wrap, free text wraps, and
while the table is too wide its borders thin and its least important columns step down to a
shorter form or are left out (the caption says which). `echo` prints a message wrapped at spaces.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from rich import box
from rich.console import Console, ConsoleOptions, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


@dataclass
class Column:
    """One column of a `FitTable`.

    name: identifiers, shown whole on one line (folded only if one is wider than the console).
    wrap: free text that may wrap onto more lines, down to `min_width` characters wide; other
    columns keep each cell on one line. drop: 0 keeps the column; otherwise, while the table is too
    wide, the columns with the highest `drop` give way to their `shorter` form (if any) or are left
    out, one level at a time.
    note: a line for the caption while this column is shown (e.g. what an abbreviated header means).
    """

    header: str
    cells: Sequence[RenderableType]
    justify: str = "left"
    name: bool = False
    wrap: bool = False
    min_width: int = 12
    drop: int = 0
    shorter: Column | None = None
    note: str = ""


def number(header: str, cells: Sequence[RenderableType], drop: int = 0, **kw: Any) -> Column:
    """A right-aligned column of numbers."""
    return Column(header, cells, justify="right", drop=drop, **kw)


@dataclass
class FitTable:
    """A table of `columns` that fits the console width it is printed at (see the module docstring).

    The table is at least as wide as its title and caption (up to the console width), so they do
    not wrap into a narrow column; `table` holds further `rich.table.Table` options."""

    columns: Sequence[Column]
    title: str | None = None
    caption: str | None = None
    table: dict[str, Any] = field(default_factory=dict)

    def layout(self, width: int) -> Table:
        """The table as it is printed `width` characters wide."""
        shown: list[Column] = list(self.columns)
        dropped: list[str] = []
        compact = squeeze = False
        while _natural_width(self._build(shown, dropped, width, compact, measure=True)) > width:
            if not compact:
                compact = True
                continue
            level = max((c.drop for c in shown), default=0)
            if level == 0:  # nothing left to give way: values fold rather than being cut
                squeeze = True
                break
            kept: list[Column] = []
            for c in shown:  # the columns of one level give way together
                if c.drop != level:
                    kept.append(c)
                elif c.shorter is not None:
                    kept.append(c.shorter)
                else:
                    dropped.append(c.header)
            shown = kept
        return self._build(shown, dropped, width, compact, squeeze=squeeze)

    def _build(self, shown: list[Column], dropped: list[str], width: int, compact: bool,
               measure: bool = False, squeeze: bool = False) -> Table:
        notes = [c.note for c in shown if c.note]
        if dropped:
            notes.append("left out at this width: " + ", ".join(dropped))
        caption = "\n".join(([self.caption] if self.caption else []) + notes) or None
        opts = dict(self.table)
        if compact:
            opts.update(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
        # as wide as the title and caption (not the notes) need, up to the width: no wrapping to a sliver
        want = max((len(line) for s in (self.title, self.caption) if s for line in s.splitlines()), default=0)
        opts["min_width"] = max(opts.get("min_width") or 0, min(want, width))
        t = Table(title=self.title, caption=caption, **opts)
        for c in shown:
            longest = max((Measurement.get(_MEASURE, _MEASURE.options, x).maximum for x in c.cells), default=0)
            longest = max(longest, len(c.header))
            if c.name:
                fits = longest <= width
                t.add_column(c.header, justify=c.justify, no_wrap=fits, overflow="fold", min_width=longest if fits else None)
            elif c.wrap:
                t.add_column(c.header, justify=c.justify, overflow="fold",
                             max_width=min(c.min_width, longest) if measure else None)
            else:
                t.add_column(c.header, justify=c.justify, no_wrap=not squeeze, overflow="fold")
        for row in zip(*(c.cells for c in shown)):
            t.add_row(*row)
        return t

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Table]:
        yield self.layout(options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.layout(options.max_width))


class FirstThatFits:
    """The first of `choices` whose natural width fits the console, else the last: a table keeps
    its full layout where there is room and a narrower one elsewhere."""

    def __init__(self, *choices: RenderableType) -> None:
        self.choices = choices

    def _pick(self, options: ConsoleOptions) -> RenderableType:
        for c in self.choices[:-1]:
            if _natural_width(c, options) <= options.max_width:
                return c
        return self.choices[-1]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[RenderableType]:
        yield self._pick(options)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self._pick(options))


# measuring needs a console; this one is never printed to
_MEASURE = Console(width=10_000, file=None, color_system=None, force_terminal=False)


def _natural_width(renderable: RenderableType, options: ConsoleOptions | None = None) -> int:
    """Columns `renderable` takes when nothing constrains it (no cell wraps or shrinks)."""
    opts = (options or _MEASURE.options).update(max_width=10_000)
    return Measurement.get(_MEASURE, opts, renderable).maximum


def echo(message: str, console: Console | None = None, head: str = "", head_style: str | None = None,
         indent: str = "") -> None:
    """Print `head + message` wrapped at spaces to the console width, lines after the first
    starting with `indent`; a word wider than the console (a path, a URL) stays whole on a line of
    its own. `head` is shown in `head_style`; no markup is read from either."""
    console = console or Console()
    lines: list[str] = []
    for para in (head + message).splitlines() or [""]:
        lines += textwrap.wrap(para, console.width, subsequent_indent=indent, break_long_words=False,
                               break_on_hyphens=False) or [""]
    text = Text("\n".join(lines))
    if head and head_style:
        text.stylize(head_style, 0, len(head.rstrip()))
    console.print(text, soft_wrap=True, highlight=False)  # already wrapped: nothing more to wrap or crop
