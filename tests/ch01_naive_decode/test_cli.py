"""The command line: bad options fail fast (before any model loads) with one line and exit code 2; a good run
reports time to first token and decode speed apart; `--chapter` runs another checkpoint with the options its
declared capabilities accept; the loader's own checks decide what a model path is and when it is converted."""

import importlib
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from chapters import submodule
from tests.conftest import ROOT


@pytest.fixture
def cli(checkpoint):
    """The checkpoint's `__main__` module: `python -m rosellm` of that chapter."""
    return submodule(checkpoint, "__main__")


def never_load(*args, **kwargs):
    raise AssertionError("the model was loaded although an option was bad")


class FakeCheckpoint:
    """What `chapters.checkpoint(n)` returns, around a package whose `LLM` records its options."""

    def __init__(self, number: int, capabilities: set[str]):
        self.number, self.capabilities = number, frozenset(capabilities)
        self.llm_options = None

    def load(self):
        from rosellm import SamplingParams

        checkpoint = self

        class RecordingLLM:
            def __init__(self, model=None, **options):
                checkpoint.llm_options = options

            def stream(self, prompt, params):
                yield "Paris"
                return SimpleNamespace(token_ids=[7, 8, 9], prompt_token_ids=[1, 2])

        return SimpleNamespace(LLM=RecordingLLM, SamplingParams=SamplingParams)


def fake_chapters_answering(monkeypatch, known: dict[int, FakeCheckpoint]) -> dict[int, FakeCheckpoint]:
    """`chapters.checkpoint` answering the chapters of `known` ("03", "ch03", 3), ValueError otherwise."""

    def checkpoint(name):
        digits = str(name).removeprefix("ch")[:2]
        if not digits.isdigit() or int(digits) not in known:
            raise ValueError(f"no chapter {name!r}")
        return known[int(digits)]

    import chapters

    monkeypatch.setattr(chapters, "checkpoint", checkpoint, raising=False)
    return known


def assert_fails_fast(cli, argv: list[str], capsys, monkeypatch) -> str:
    """Run the command line on `argv`; it must stop before loading, with exit code 2 and one line on stderr."""
    monkeypatch.setattr(cli, "load_llm", never_load)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rosellm") and "error:" in err, err
    return err


BAD_OPTIONS = {
    "negative temperature": ["--temperature", "-1"],
    "zero max tokens": ["--max-tokens", "0"],
    "top-p zero": ["--top-p", "0"],
    "top-p above one": ["--top-p", "1.5"],
    "negative top-k": ["--top-k", "-1"],
    "not a number": ["--max-tokens", "many"],
    "missing model file": ["--model", "/nonexistent/model.gguf"],
    "unknown device": ["--device", "abacus"],
    "unknown chapter": ["--chapter", "99"],
}


@pytest.mark.parametrize("options", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_option_fails_fast_with_one_line(cli, options, monkeypatch, capsys):
    fake_chapters_answering(monkeypatch, {3: FakeCheckpoint(3, set())})
    assert_fails_fast(cli, ["generate", "hello", *options], capsys, monkeypatch)


def test_a_folder_without_config_is_refused_as_the_loader_refuses_it(checkpoint, cli, tmp_path, monkeypatch, capsys):
    with pytest.raises(FileNotFoundError) as refused:
        checkpoint.loader.model_source(tmp_path)
    err = assert_fails_fast(cli, ["generate", "hello", "--model", str(tmp_path)], capsys, monkeypatch)
    assert str(refused.value) in err


def test_chapter_without_a_clone_says_so(cli, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "chapters", None)  # as for a user who pip-installed only rosellm
    err = assert_fails_fast(cli, ["generate", "hello", "--chapter", "03"], capsys, monkeypatch)
    assert "clone" in err


def test_bad_option_from_the_shell_has_no_traceback(checkpoint):
    run = subprocess.run(
        [sys.executable, "-m", checkpoint.__name__, "generate", "hi", "--temperature", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert "--temperature" in run.stderr


def test_help_shows_every_default(cli, capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 128)", "(default: 0.0)", "(default: 1.0)", "(default: 0)", "(default: cpu)"):
        assert default in out


def test_chapter_runs_that_checkpoint(cli, monkeypatch, capsys):
    known = fake_chapters_answering(monkeypatch, {3: FakeCheckpoint(3, set())})
    cli.main(["generate", "hello", "--raw", "--chapter", "03", "--device", "cpu"])
    assert known[3].llm_options == {"device": "cpu"}
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "decode 2 tokens" in captured.err


def test_run_reports_time_to_first_token_and_decode_apart(cli, tiny_model_dirs, capsys):
    cli.main(["generate", "The quick brown fox", "--raw", "--model", str(tiny_model_dirs["gqa"]), "--max-tokens", "4"])
    err = capsys.readouterr().err
    assert "loading gqa on cpu ... done in" in err
    timing = err.strip().splitlines()[-1]
    assert "time to first token" in timing and "prompt tokens" in timing and "decode" in timing


def test_chat_template_or_its_fallback_wraps_the_question(cli, tiny_model_dirs, capsys):
    """The tiny model's tokenizer has no chat template: the question goes in as "user: ...", then "assistant:"."""
    cli.main(["generate", "Hi", "--model", str(tiny_model_dirs["gqa"]), "--max-tokens", "2"])
    assert "prefill" in capsys.readouterr().err
    template = importlib.import_module(f"{cli.__package__}.chat_template")
    tokenizer = SimpleNamespace(chat_template=None)
    assert template.chat_prompt(tokenizer, [{"role": "user", "content": "Hi"}]) == "user: Hi\nassistant:"


def test_conversion_notice_predicts_the_loader_cache(checkpoint, cli, tmp_path, monkeypatch):
    """The CLI announces a conversion exactly when the loader's cache folder does not exist yet."""
    loader = checkpoint.loader
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not read: the conversion is replaced below")
    monkeypatch.setattr(
        loader, "write_hf_folder_from_gguf", lambda path, out: (out / "model.safetensors").write_bytes(b"")
    )
    assert cli.needs_conversion(gguf)
    assert loader.gguf_to_hf_folder(gguf) == loader.gguf_cache_folder(gguf)
    assert not cli.needs_conversion(gguf)


def test_first_run_times_the_conversion_apart_from_the_load(checkpoint, cli, tmp_path, monkeypatch, capsys):
    """A first run says how long the GGUF conversion took, measured (never a guess), and then the load."""
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not read: the conversion is replaced below")

    def slow_conversion(path, out):
        time.sleep(0.5)
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(checkpoint.loader, "write_hf_folder_from_gguf", slow_conversion)
    converted_before_load = []
    package = SimpleNamespace(LLM=lambda model, **options: converted_before_load.append(not cli.needs_conversion(gguf)))
    cli.load_llm(package, str(gguf), gguf, {"device": "cpu"})
    assert converted_before_load == [True]
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(" ", 2)[:2] for line in lines] == [["converting", "tiny.gguf"], ["loading", "tiny.gguf"]]
    assert "~" not in lines[0]
    seconds = [float(re.fullmatch(r".* \.\.\. done in (\d+\.\d) s", line).group(1)) for line in lines]
    assert seconds[0] >= 0.5 > seconds[1]
