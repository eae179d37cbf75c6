"""`--no-int8-activations` reaches the engine's options (int8_activations=False); a checkpoint before chapter 18
refuses it in one line before the model loads."""

import pytest

from chapters import submodule
from tests.ch01_naive_decode.test_cli import FakeCheckpoint, assert_fails_fast, fake_chapters_answering

pytestmark = pytest.mark.requires("integer_dot")
BEFORE = {"compiled", "tensor_parallel", "quantization", "speculative_decoding"}


@pytest.fixture
def cli(checkpoint):
    return submodule(checkpoint, "__main__")


@pytest.fixture
def fake_chapters(monkeypatch):
    """`chapters.checkpoint` answering 17 (exact products only) and 18 (integer dot products)."""
    return fake_chapters_answering(
        monkeypatch, {17: FakeCheckpoint(17, BEFORE), 18: FakeCheckpoint(18, BEFORE | {"integer_dot"})}
    )


def test_the_flag_turns_the_option_off(cli):
    for command in (["generate", "hello"], ["demo"], ["serve"]):
        args = cli.build_parser().parse_args([*command, "--quantization", "gguf", "--no-int8-activations"])
        assert cli.engine_options(args) == {"device": "cpu", "quantization": "gguf", "int8_activations": False}


def test_chapter_18_gets_it(cli, fake_chapters):
    cli.main(["generate", "hello", "--raw", "--chapter", "18", "--quantization", "gguf", "--no-int8-activations"])
    assert fake_chapters[18].llm_options == {"device": "cpu", "quantization": "gguf", "int8_activations": False}


def test_before_chapter_18_fails_fast_with_one_line(cli, fake_chapters, monkeypatch, capsys):
    command = ["generate", "hello", "--chapter", "17", "--no-int8-activations"]
    err = assert_fails_fast(cli, command, capsys, monkeypatch)
    assert "chapter 17" in err and "chapter 18" in err, err
