"""`python -m rosellm serve`'s chapter 16 options: `--data-parallel-size N` engine cores, `--in-process` for chapter
10's arrangement; what cannot work fails before anything loads, with one line and exit code 2."""

import pytest

from chapters import submodule
from tests.ch01_naive_decode.test_cli import assert_fails_fast

pytestmark = pytest.mark.requires("engine_core")


@pytest.fixture
def cli(checkpoint):
    return submodule(checkpoint, "__main__")


@pytest.mark.parametrize(
    "options, words",
    [
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["--in-process", "--data-parallel-size", "2"], "not with --in-process"),
    ],
    ids=["zero cores", "replicas in process"],
)
def test_bad_core_options_fail_fast(cli, options, words, monkeypatch, capsys):
    assert words in assert_fails_fast(cli, ["serve", *options], capsys, monkeypatch)


def test_help_names_the_split_and_its_alternative(cli, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--data-parallel-size" in out and "(default: 1)" in out and "--in-process" in out
