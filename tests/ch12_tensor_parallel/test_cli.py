"""`--tensor-parallel-size` reaches the engine's options; a checkpoint that runs in one process refuses it in
one line."""

import pytest

from chapters import submodule
from tests.ch01_naive_decode.test_cli import FakeCheckpoint, fake_chapters_answering, never_load

cli = submodule("rosellm", "__main__")  # the command line, wherever the latest package keeps it


@pytest.fixture
def fake_chapters(monkeypatch):
    """`chapters.checkpoint` answering 11 (one process) and 12 (tensor parallel)."""
    return fake_chapters_answering(
        monkeypatch, {11: FakeCheckpoint(11, {"compiled"}), 12: FakeCheckpoint(12, {"compiled", "tensor_parallel"})}
    )


def test_tensor_parallel_size_is_an_engine_option(fake_chapters):
    args = cli.build_parser().parse_args(["serve", "--tensor-parallel-size", "3"])
    assert cli.engine_options(args) == {"device": "cpu", "tensor_parallel_size": 3}
    assert "tensor_parallel_size" not in cli.engine_options(cli.build_parser().parse_args(["demo"]))
    cli.main(["generate", "hello", "--raw", "--chapter", "12", "--tensor-parallel-size", "2"])
    assert fake_chapters[12].llm_options == {"device": "cpu", "tensor_parallel_size": 2}


def test_tensor_parallel_size_before_chapter_12_fails_fast_with_one_line(fake_chapters, monkeypatch, capsys):
    monkeypatch.setattr(cli, "load_llm", never_load)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hello", "--chapter", "11", "--tensor-parallel-size", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tensor-parallel-size" in err and "chapter 11" in err, err
