"""The matrix's shared pieces: the fp32 reference (computed once per session), the
tokenizer's decoder for failure messages, and the table of the rows every path added
(rows.ROWS), printed at the end of the run (`pytest_terminal_summary`)."""

from __future__ import annotations

import pathlib
import sys

import pytest

# The harnesses the matrix reuses live beside their own tests (P/D: tests/disaggregation,
# adapters: tests/lora, replica processes: tests/e2e, tiny LLaVA: tests/multimodal); their folders are on sys.path only while pytest imports their
# conftests, so the matrix adds them itself.
for folder in ("disaggregation", "lora", "e2e", "multimodal"):
    path = str(pathlib.Path(__file__).parents[1] / folder)
    if path not in sys.path:
        sys.path.append(path)


@pytest.fixture(scope="session")
def matrix_reference(tiny_llama_dir):
    """(answers, decode): every request's answer from the offline float32 engine."""
    from reference import reference_answers, reference_llm  # lazy: loads the engine
    from request_set import REQUESTS  # lazy: beside the import above

    llm = reference_llm(tiny_llama_dir)
    tokenizer = llm.get_tokenizer()
    answers = reference_answers(llm, REQUESTS)
    del llm  # its KV pool is gigabytes: not held while the clusters run
    stop = answers["stop"].choices[0]
    # The stop request tests stop strings only if the reference does stop on its string.
    assert stop.finish_reason == "stop", f"the stop string is never written: {stop.text!r}"
    return answers, lambda ids: tokenizer.decode(ids)


def pytest_collection_modifyitems(config, items):
    """Without PAGODA_MATRIX=full, only the cut runs: the full matrix's tests are
    deselected (not skipped: `make test` lists no dozen skips for them)."""
    import os  # lazy: read at collection only

    if os.environ.get("PAGODA_MATRIX") == "full":
        return
    full = [item for item in items if item.get_closest_marker("matrix_full")]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if item not in full]


def pytest_terminal_summary(terminalreporter):
    rows = sys.modules.get("rows")  # the matrix's rows.py, once a matrix test imported it
    if rows is not None and getattr(rows, "ROWS", None):
        terminalreporter.write_sep("=", "differential matrix: same answer on every path")
        terminalreporter.write_line(rows.table(rows.ROWS))
