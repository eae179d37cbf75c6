"""The command line: bad options fail fast (before any model loads) with one line and exit code 2;
a good run reports time to first token and decode speed apart; `--chapter` passes a checkpoint only
the options its declared capabilities accept."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import rosellm
from rosellm import __main__ as cli
from rosellm import loader

ROOT = Path(__file__).resolve().parents[2]


def never_load(*args, **kwargs):
    raise AssertionError("the model was loaded although an option was bad")


class FakeCheckpoint:
    """What `chapters.checkpoint(n)` returns, around a package whose `LLM` records its options."""

    def __init__(self, number: int, capabilities: set[str]):
        self.number, self.capabilities = number, frozenset(capabilities)
        self.llm_options = None

    def load(self):
        checkpoint = self

        class RecordingLLM:
            def __init__(self, model=None, **options):
                checkpoint.llm_options = options

            def stream(self, prompt, params):
                yield "Paris"
                return SimpleNamespace(token_ids=[7, 8, 9], prompt_token_ids=[1, 2])

        return SimpleNamespace(__name__="rosellm", LLM=RecordingLLM, SamplingParams=rosellm.SamplingParams)


@pytest.fixture
def fake_chapters(monkeypatch):
    """`chapters.checkpoint` answering 3 (no attention backends) and 6 (Triton kernels), ValueError otherwise."""
    known = {3: FakeCheckpoint(3, {"step_engine"}), 6: FakeCheckpoint(6, {"paged", "triton_kernels"})}

    def checkpoint(name):
        number = int(str(name).removeprefix("ch")[:2]) if str(name).removeprefix("ch")[:2].isdigit() else -1
        if number not in known:
            raise ValueError(f"no chapter {name!r}")
        return known[number]

    import chapters

    monkeypatch.setattr(chapters, "checkpoint", checkpoint, raising=False)
    return known


BAD_OPTIONS = {
    "negative temperature": ["--temperature", "-1"],
    "zero max tokens": ["--max-tokens", "0"],
    "top-p zero": ["--top-p", "0"],
    "top-p above one": ["--top-p", "1.5"],
    "negative top-k": ["--top-k", "-1"],
    "not a number": ["--max-tokens", "many"],
    "missing model file": ["--model", "/nonexistent/model.gguf"],
    "unknown device": ["--device", "abacus"],
    "unknown backend": ["--attention-backend", "flash"],
    "triton on the cpu": ["--attention-backend", "triton", "--device", "cpu"],
    "unknown chapter": ["--chapter", "99"],
    "backend before chapter 06": ["--chapter", "03", "--attention-backend", "torch"],
}


@pytest.mark.parametrize("options", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_option_fails_fast_with_one_line(options, fake_chapters, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cli, "load_llm", never_load)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hello", *options])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rosellm") and "error:" in err, err


def test_chapter_without_a_clone_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "chapters", None)  # as for a user who pip-installed only rosellm
    monkeypatch.setattr(cli, "load_llm", never_load)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hello", "--chapter", "03"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "clone" in err


def test_bad_option_from_the_shell_has_no_traceback():
    run = subprocess.run(
        [sys.executable, "-m", "rosellm", "generate", "hi", "--temperature", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert "--temperature" in run.stderr


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 128)", "(default: 0.0)", "(default: 1.0)", "(default: 0)", "(default: cpu)"):
        assert default in out


@pytest.mark.parametrize(
    ("chapter", "options", "expected"),
    [
        ("03", [], {"device": "cpu"}),
        ("06", [], {"device": "cpu"}),
        ("06", ["--attention-backend", "torch"], {"device": "cpu", "attention_backend": "torch"}),
    ],
)
def test_chapter_gets_only_what_it_declares(chapter, options, expected, fake_chapters, capsys):
    cli.main(["generate", "hello", "--raw", "--chapter", chapter, *options])
    assert fake_chapters[int(chapter)].llm_options == expected
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "decode 2 tokens" in captured.err


def test_run_reports_time_to_first_token_and_decode_apart(tiny_model_dirs, capsys):
    cli.main(["generate", "The quick brown fox", "--raw", "--model", str(tiny_model_dirs["gqa"]), "--max-tokens", "4"])
    err = capsys.readouterr().err
    assert "loading gqa on cpu ... done in" in err
    timing = err.strip().splitlines()[-1]
    assert "time to first token" in timing and "prompt tokens" in timing and "decode" in timing


def test_conversion_notice_predicts_the_loader_cache(tmp_path, monkeypatch):
    """The CLI announces a conversion exactly when the loader's cache folder does not exist yet."""
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not read: the conversion is replaced below")
    monkeypatch.setattr(
        loader, "write_hf_folder_from_gguf", lambda path, out: (out / "model.safetensors").write_bytes(b"")
    )
    assert cli.pending_gguf_conversion(rosellm, str(gguf)) == gguf
    loader.gguf_to_hf_folder(gguf)
    assert cli.pending_gguf_conversion(rosellm, str(gguf)) is None
