"""`--attention-backend`: its choices are the checkpoint's registry (`attention_backend.BACKENDS`), the
"triton" backend's own check runs before the model loads, and a checkpoint without backends refuses it."""

import pytest

from chapters import submodule
from tests.ch01_naive_decode.test_cli import FakeCheckpoint, assert_fails_fast, fake_chapters_answering


@pytest.fixture
def cli(checkpoint):
    return submodule(checkpoint, "__main__")


@pytest.fixture
def fake_chapters(monkeypatch):
    """Chapter 03 (one attention path) and chapter 06 (backends)."""
    return fake_chapters_answering(
        monkeypatch, {3: FakeCheckpoint(3, {"batched"}), 6: FakeCheckpoint(6, {"paged", "triton_kernels"})}
    )


BAD_OPTIONS = {
    "unknown backend": ["--attention-backend", "flash"],
    "triton on the cpu": ["--attention-backend", "triton", "--device", "cpu"],
    "backend before chapter 06": ["--chapter", "03", "--attention-backend", "torch"],
}


@pytest.mark.parametrize("options", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_backend_fails_fast_with_one_line(cli, options, fake_chapters, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_fails_fast(cli, ["generate", "hello", *options], capsys, monkeypatch)


def test_triton_on_the_cpu_says_what_the_backend_says(checkpoint, cli, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as refused:
        checkpoint.attention_backend.get_attention_backend("triton", "cpu")
    err = assert_fails_fast(cli, ["generate", "hello", "--attention-backend", "triton"], capsys, monkeypatch)
    assert str(refused.value) in err


def test_every_registered_backend_is_a_choice(checkpoint, cli):
    for name in checkpoint.attention_backend.BACKENDS:
        args = cli.build_parser().parse_args(["generate", "hello", "--attention-backend", name])
        assert cli.engine_options(args) == {"device": "cpu", "attention_backend": name}
    assert "attention_backend" not in cli.engine_options(cli.build_parser().parse_args(["demo"]))


def test_chapter_06_gets_the_backend(cli, fake_chapters, capsys):
    cli.main(["generate", "hello", "--raw", "--chapter", "06", "--attention-backend", "torch"])
    assert fake_chapters[6].llm_options == {"device": "cpu", "attention_backend": "torch"}
    assert "Paris" in capsys.readouterr().out
