"""The termination message (what Kubernetes shows as a container's last state) and the argument checks
of ``tokenfleet serve`` whose failures it carries."""
from __future__ import annotations

import pytest

from tokenfleet_serving.contract import termination
from tokenfleet_serving.serve_args import build_parser


def test_the_message_is_one_line_of_at_most_4096_bytes(tmp_path, monkeypatch):
    path = tmp_path / "log"
    monkeypatch.setenv(termination.ENV, str(path))
    assert termination.write_termination_message("first line\nsecond\tline  ") == str(path)
    assert path.read_text() == "first line second line"
    termination.write_termination_message("é" * 5000)          # 2 bytes each: cut on a character boundary
    data = path.read_bytes()
    assert len(data) <= 4096 and data.decode("utf-8") == "é" * (len(data) // 2)


def test_the_kubelet_path_is_used_only_when_it_exists(tmp_path, monkeypatch):
    monkeypatch.delenv(termination.ENV, raising=False)
    default = tmp_path / "termination-log"
    monkeypatch.setattr(termination, "DEFAULT_PATH", str(default))
    assert termination.write_termination_message("x") is None and not default.exists()
    default.write_text("")                                       # the kubelet creates the file
    assert termination.write_termination_message("why") == str(default) and default.read_text() == "why"


def test_an_unwritable_path_never_fails_the_caller(tmp_path, monkeypatch):
    monkeypatch.setenv(termination.ENV, str(tmp_path / "no" / "such" / "dir" / "log"))
    assert termination.write_termination_message("x") is None


def test_argument_errors_exit_2_and_leave_the_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(termination.ENV, str(tmp_path / "log"))
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--model", "m", "--served-model-name=-x"])
    assert exit_.value.code == 2
    assert "'-x' is not a valid model name" in capsys.readouterr().err
    assert (tmp_path / "log").read_text().startswith("tokenfleet serve: error: argument --served-model-name: '-x'")


@pytest.mark.parametrize("name", ["tiny", "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B:v2", "org_model@rev",
                                  "x" * 128, "_private"])
def test_names_as_served_in_the_wild_are_accepted(name):
    assert build_parser().parse_args(["--model", "m", "--served-model-name", name]).served_model_name == [name]


@pytest.mark.parametrize("name", ["-x", "--api-key", "has space", "tab\tname", "x" * 129, "", "bell\x07"])
def test_names_that_are_not_plain_names_are_refused(name, tmp_path, monkeypatch):
    monkeypatch.setenv(termination.ENV, str(tmp_path / "log"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", f"--served-model-name={name}"])


def test_argument_error_says_what_serve_would_exit_2_with(tmp_path, monkeypatch):
    from tokenfleet_serving.serve_args import argument_error

    monkeypatch.setenv(termination.ENV, str(tmp_path / "log"))
    assert argument_error(["--model", "/m", "--served-model-name", "llama", "--max-num-seqs", "8"]) is None
    assert argument_error(["--model", "/m", "--served-model-name=--api-key"]) == (
        "tokenfleet serve: error: argument --served-model-name: '--api-key' is not a valid model name: "
        "1-128 characters, no whitespace, not starting with '-'")
    assert argument_error(["--model", "/m", "--bogus", "1"]) == "tokenfleet serve: error: unrecognized arguments: --bogus 1"
    assert argument_error(["--served-model-name", "x"]).endswith("the following arguments are required: --model")
    assert not (tmp_path / "log").exists(), "a check is not a termination"
