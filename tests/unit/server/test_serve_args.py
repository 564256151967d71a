"""``ServeArgs``: one typed field per ``tokenfleet serve`` flag, the parser built from the fields."""
from __future__ import annotations

import dataclasses

import pytest

from tokenfleet_serving.serve_args import ServeArgs, ServeArgsError, argument_error, build_parser, flag_name, parse_serve_args


def test_every_field_is_a_flag_with_the_fields_default():
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(flags) == {f.name for f in dataclasses.fields(ServeArgs)}
    for f in dataclasses.fields(ServeArgs):
        assert flag_name(f.name) in flags[f.name].option_strings
        if f.name != "model":
            assert flags[f.name].default == f.default, f.name
    args = parse_serve_args(["--model", "/m"])
    assert args == ServeArgs(model="/m") and args.served_model_names == ("/m",)


def test_values_are_typed_and_checked():
    args = parse_serve_args(["--model", "/m", "--served-model-name", "a", "--served-model-name", "b",
                             "--max-num-seqs", "8", "--drain-timeout", "1.5", "--tool-call-parser", "mistral"])
    assert (args.served_model_names, args.max_num_seqs, args.drain_timeout, args.tool_call_parser) == \
        (("a", "b"), 8, 1.5, "mistral")
    with pytest.raises(ServeArgsError, match="--max-num-seqs"):
        parse_serve_args(["--model", "/m", "--max-num-seqs", "0"])


def test_tool_call_parser_flags():
    assert "invalid choice: 'pythonic'" in argument_error(["--model", "/m", "--tool-call-parser", "pythonic"])
    assert argument_error(["--model", "/m", "--enable-auto-tool-choice"]).endswith(
        "--enable-auto-tool-choice needs --tool-call-parser")
    assert argument_error(["--model", "/m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) is None
