"""`--quantization` and `--dtype` reach the engine's options; a bad one, or a checkpoint before chapter 13,
is refused in one line before the model loads."""

import pytest

from chapters import submodule
from tests.ch01_naive_decode.test_cli import FakeCheckpoint, assert_fails_fast, fake_chapters_answering

pytestmark = pytest.mark.requires("quantization")


@pytest.fixture
def cli(checkpoint):
    return submodule(checkpoint, "__main__")


@pytest.fixture
def fake_chapters(monkeypatch):
    """`chapters.checkpoint` answering 12 (fp32 weights) and 13 (quantization)."""
    return fake_chapters_answering(
        monkeypatch,
        {
            12: FakeCheckpoint(12, {"compiled", "tensor_parallel"}),
            13: FakeCheckpoint(13, {"compiled", "tensor_parallel", "quantization"}),
        },
    )


def test_quantization_and_dtype_are_engine_options(cli):
    for command in (["generate", "hello"], ["demo"], ["serve"]):
        args = cli.build_parser().parse_args([*command, "--quantization", "int4", "--dtype", "float32"])
        assert cli.engine_options(args) == {"device": "cpu", "quantization": "int4", "dtype": "float32"}
        assert cli.engine_options(cli.build_parser().parse_args(command)) == {"device": "cpu"}


def test_chapter_13_gets_them(cli, fake_chapters, capsys):
    cli.main(["generate", "hello", "--raw", "--chapter", "13", "--quantization", "gguf"])
    assert fake_chapters[13].llm_options == {"device": "cpu", "quantization": "gguf"}


@pytest.mark.parametrize("option", [["--quantization", "int8"], ["--dtype", "float32"]])
def test_before_chapter_13_fails_fast_with_one_line(cli, fake_chapters, monkeypatch, capsys, option):
    err = assert_fails_fast(cli, ["generate", "hello", "--chapter", "12", *option], capsys, monkeypatch)
    assert "chapter 12" in err and "chapter 13" in err, err


def test_bad_combinations_fail_fast_with_one_line(cli, tiny_model_dirs, monkeypatch, capsys):
    folder = str(tiny_model_dirs["gqa"])
    bad = {
        "a .gguf file": ["--model", folder, "--quantization", "gguf"],
        "one process": ["--model", folder, "--quantization", "int4", "--tensor-parallel-size", "2"],
        "invalid choice": ["--quantization", "fp8"],
    }
    for message, options in bad.items():
        err = assert_fails_fast(cli, ["generate", "hello", *options], capsys, monkeypatch)
        assert message in err, err
    err = assert_fails_fast(cli, ["serve", "--model", folder, "--quantization", "gguf"], capsys, monkeypatch)
    assert "a .gguf file" in err, err
