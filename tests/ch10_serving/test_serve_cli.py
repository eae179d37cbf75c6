"""`python -m rosellm serve`: a bad option or a taken port fails before the model loads, with one line and exit
code 2; a real run serves the API at the address it prints and stops cleanly on Ctrl-C."""

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from chapters import submodule
from tests.ch01_naive_decode.test_cli import assert_fails_fast

pytestmark = pytest.mark.requires("serving")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli(checkpoint):
    return submodule(checkpoint, "__main__")


BAD_OPTIONS = {
    "port above 65535": ["--port", "70000"],
    "negative port": ["--port", "-1"],
    "missing model": ["--model", "/nonexistent/model.gguf"],
    "zero max-num-seqs": ["--max-num-seqs", "0"],
    "max-model-len of one": ["--max-model-len", "1"],
    "unknown device": ["--device", "abacus"],
    "triton on the cpu": ["--attention-backend", "triton"],
}


@pytest.mark.parametrize("options", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_serve_option_fails_fast_with_one_line(cli, options, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_fails_fast(cli, ["serve", *options], capsys, monkeypatch)


def test_a_taken_port_fails_before_the_model_loads(cli, monkeypatch, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        err = assert_fails_fast(cli, ["serve", "--port", str(port)], capsys, monkeypatch)
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_help_shows_the_serve_defaults(cli, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 127.0.0.1)", "(default: 8000)", "(default: 32)"):
        assert default in out


def test_serve_answers_and_stops_on_ctrl_c(tiny_model_dirs):
    model = tiny_model_dirs["gqa"]
    command = [sys.executable, "-m", "rosellm", "serve", "--model", str(model), "--port", "0", "--max-num-seqs", "4"]
    # Ctrl-C as in a terminal, even when this suite runs as a background job (which starts with SIGINT ignored,
    # and a child would inherit that)
    restore_ctrl_c = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, preexec_fn=restore_ctrl_c)
    lines = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True)
    reader.start()
    try:
        while not (address := re.search(r"serving gqa at (http://127\.0\.0\.1:\d+/v1)", line := lines.get(timeout=60))):
            assert "Traceback" not in line, line
        url = address.group(1)
        assert httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"] == "gqa"
        body = {"model": "gqa", "prompt": "The quick brown fox", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{url}/completions", json=body, timeout=30).json()["usage"]["completion_tokens"] == 4
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 130
    finally:
        if process.poll() is None:
            process.kill()
    reader.join(timeout=10)
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert not any("Traceback" in line for line in rest), "".join(rest)
