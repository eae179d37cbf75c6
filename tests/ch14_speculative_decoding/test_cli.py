"""`--speculative-config JSON` reaches the engine's options as a `SpeculativeConfig`; a bad one, or a checkpoint
before chapter 14, is refused in one line before the model loads."""

import json

import pytest

from chapters import submodule
from tests.ch01_naive_decode.test_cli import FakeCheckpoint, assert_fails_fast, fake_chapters_answering

pytestmark = pytest.mark.requires("speculative_decoding")

COMMANDS = {"generate": ["generate", "hello"], "demo": ["demo"], "serve": ["serve"]}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest.fixture
def cli(checkpoint):
    return submodule(checkpoint, "__main__")


@pytest.fixture
def speculative_config(checkpoint):
    return submodule(checkpoint, "speculative_config")


@pytest.fixture
def fake_chapters(monkeypatch):
    """`chapters.checkpoint` answering 13 (quantization) and 14 (speculative decoding)."""
    before = {"compiled", "tensor_parallel", "quantization"}
    return fake_chapters_answering(
        monkeypatch,
        {13: FakeCheckpoint(13, before), 14: FakeCheckpoint(14, before | {"speculative_decoding"})},
    )


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_the_speculative_config_is_an_engine_option(cli, speculative_config, command):
    args = cli.build_parser().parse_args([*command, "--speculative-config", json.dumps(NGRAM)])
    options = cli.engine_options(args)
    assert options == {"device": "cpu", "speculative_config": speculative_config.SpeculativeConfig(**NGRAM)}
    assert isinstance(options["speculative_config"], speculative_config.SpeculativeConfig)
    assert options["speculative_config"].prompt_lookup_min == 3  # vLLM's defaults applied: min follows max
    assert cli.engine_options(cli.build_parser().parse_args(command)) == {"device": "cpu"}


def test_chapter_14_gets_it(cli, speculative_config, fake_chapters, capsys):
    cli.main(["generate", "hello", "--raw", "--chapter", "14", "--speculative-config", json.dumps(NGRAM)])
    expected = speculative_config.SpeculativeConfig(**NGRAM)
    assert fake_chapters[14].llm_options == {"device": "cpu", "speculative_config": expected}


def test_before_chapter_14_fails_fast_with_one_line(cli, fake_chapters, monkeypatch, capsys):
    argv = ["generate", "hello", "--chapter", "13", "--speculative-config", json.dumps(NGRAM)]
    err = assert_fails_fast(cli, argv, capsys, monkeypatch)
    assert "--speculative-config" in err and "chapter 13" in err and "chapter 14" in err, err


BAD_CONFIGS = {
    "not JSON": ("{'method': 'ngram'}", "not JSON"),
    "unknown method": ('{"method": "eagle", "num_speculative_tokens": 4}', "method must be one of ngram, draft_model"),
    "k below one": ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be >= 1"),
    "unknown key": ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}', "unknown keys ['lookahead']"),
}


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
@pytest.mark.parametrize("config, message", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_a_bad_config_fails_fast_with_one_line(cli, monkeypatch, capsys, command, config, message):
    err = assert_fails_fast(cli, [*command, "--speculative-config", config], capsys, monkeypatch)
    assert "--speculative-config" in err and message in err, err


@pytest.mark.parametrize("command", [COMMANDS["generate"], COMMANDS["serve"]], ids=["generate", "serve"])
def test_a_draft_with_another_vocabulary_fails_fast_with_one_line(
    cli, tiny_model_dirs, smollm2_path, monkeypatch, capsys, command
):
    """The tiny model (384 tokens) as the target, SmolLM2 (49152 tokens) as its draft, compared from their
    headers (the draft unquantized, so that its header is read once)."""
    draft = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(smollm2_path), "quantization": None}
    argv = [*command, "--model", str(tiny_model_dirs["gqa"]), "--speculative-config", json.dumps(draft)]
    err = assert_fails_fast(cli, argv, capsys, monkeypatch)
    assert "--speculative-config" in err and "vocabulary (49152 tokens)" in err and "(384 tokens)" in err, err
