"""One path's row of the matrix: each request's answer checked against the expected one,
summed up per column (request_set.COLUMNS) and printed as a table.

A cell is "ok" (every request of the column gave the expected answer), "FAIL", "n/a"
(the path cannot serve that request: the reason is in the path's notes) or "same-seed"
(the path need not give the reference's answer by design, e.g. seeded sampling under
speculation, and the check that holds instead passed: the same request twice on that
path gives the same tokens)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from compare import Answer, first_difference
from request_set import COLUMNS, REQUESTS

ROWS: list["Row"] = []  # every path's row, in the order the paths ran (test_matrix.record)


@dataclass
class Row:
    """`failures`: one line per failed request, naming the path and the request."""

    path: str
    cells: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    notes: str = ""


def check_row(path: str, want: dict[str, Answer], got: dict[str, Answer], tol: float,
              decode=None, again: dict[str, Answer] | None = None,
              not_applicable: tuple[str, ...] = (), notes: str = "",
              requests=REQUESTS) -> Row:
    """The row of `path`: `got` against `want` (token ids exactly, logprobs within `tol`).
    `again`: a second answer for the seeded requests, which are then checked against it
    instead of `want` (see the module docstring); `not_applicable`: columns not checked;
    `requests`: the request set the answers are for (the text set by default)."""
    row = Row(path, notes=notes)
    status: dict[str, list[bool]] = {c: [] for c in COLUMNS}
    for request in requests:
        if request.column in not_applicable or request.name not in got:
            continue
        expected = want[request.name]
        column = request.column
        if again is not None and request.seeded:
            expected, column = again[request.name], "same-seed:" + request.column
        tokens = first_difference(expected, got[request.name], math.inf, decode)
        values = first_difference(expected, got[request.name], tol, decode)
        status[request.column].append(tokens is None)
        if tokens is not None:
            row.failures.append(f"{path} / {request.name}: {tokens}")
        elif not column.startswith("same-seed"):
            status["logprobs"].append(values is None)
            if values is not None:
                row.failures.append(f"{path} / {request.name}: {values}")
        if column.startswith("same-seed"):
            row.cells[request.column] = "same-seed"
    for column, results in status.items():
        if not results:
            row.cells.setdefault(column, "n/a")
        elif not all(results):
            row.cells[column] = "FAIL"
        else:
            row.cells.setdefault(column, "ok")
    return row


def table(rows: list[Row]) -> str:
    """The path x checks table, one line per path, with each row's notes below it."""
    width = max([len("path"), *(len(r.path) for r in rows)])
    head = "path".ljust(width) + " | " + " | ".join(c.ljust(9) for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append(row.path.ljust(width) + " | " + " | ".join(
            row.cells.get(c, "").ljust(9) for c in COLUMNS))
        if row.notes:
            lines.append(" " * width + "   " + row.notes)
    return "\n".join(lines)
