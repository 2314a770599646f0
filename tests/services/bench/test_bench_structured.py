"""`pagoda bench serve --structured MODE`: the constraints it sends are valid ones."""

from __future__ import annotations

import argparse

import pytest

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.services.bench.serve import add_parser
from pagoda.services.bench.structured import MODES, structured_fields
from pagoda.structured_output.xgrammar_backend import XgrammarBackend


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_sends_one_constraint_the_backend_accepts(mode):
    fields = structured_fields(mode)
    params = StructuredOutputsParams(**fields["structured_outputs"])
    XgrammarBackend.parse(params)  # raises ValueError for an invalid constraint
    assert params.kind == {"json_schema": "json", "regex": "regex", "choice": "choice"}[mode]


def test_the_flag_defaults_to_free_text():
    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    assert parser.parse_args([]).structured is None and structured_fields(None) == {}
    assert parser.parse_args(["--structured", "regex"]).structured == "regex"
