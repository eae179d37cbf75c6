"""`--enforce-eager` reaches the engine's options, and a checkpoint that compiles nothing refuses it in one line."""

import pytest

from chapters import submodule
from tests.ch01_naive_decode.test_cli import FakeCheckpoint, assert_fails_fast, fake_chapters_answering


@pytest.fixture
def cli(checkpoint):
    return submodule(checkpoint, "__main__")


@pytest.fixture
def fake_chapters(monkeypatch):
    """`chapters.checkpoint` answering 6 (Triton kernels, nothing compiled) and 11 (compiled)."""
    return fake_chapters_answering(
        monkeypatch,
        {6: FakeCheckpoint(6, {"paged", "triton_kernels"}), 11: FakeCheckpoint(11, {"triton_kernels", "compiled"})},
    )


def test_enforce_eager_is_an_engine_option(cli):
    args = cli.build_parser().parse_args(["generate", "hello", "--enforce-eager"])
    assert cli.engine_options(args) == {"device": "cpu", "enforce_eager": True}
    args = cli.build_parser().parse_args(["serve", "--enforce-eager"])
    assert cli.engine_options(args)["enforce_eager"] is True
    assert "enforce_eager" not in cli.engine_options(cli.build_parser().parse_args(["generate", "hello"]))


def test_chapter_11_gets_enforce_eager(cli, fake_chapters, capsys):
    cli.main(["generate", "hello", "--raw", "--chapter", "11", "--enforce-eager"])
    assert fake_chapters[11].llm_options == {"device": "cpu", "enforce_eager": True}


def test_enforce_eager_before_chapter_11_fails_fast_with_one_line(cli, fake_chapters, monkeypatch, capsys):
    err = assert_fails_fast(cli, ["generate", "hello", "--chapter", "06", "--enforce-eager"], capsys, monkeypatch)
    assert "--enforce-eager" in err and "chapter 06" in err, err
