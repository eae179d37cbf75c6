"""The chapter's benchmark workload, `python -m benchmarks serve`, on a tiny model: the server it starts answers
every request of every rate, the numbers are sane, and no server process is left behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def process_group_members(group: int) -> list[int]:
    """Pids of the live processes whose process group is `group` (Linux' /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@pytest.mark.workload("serve")
def test_serve_quick_completes_every_request_and_leaves_no_server(tiny_model_dirs, tmp_path):
    json_path, figure = tmp_path / "result.json", tmp_path / "figure.png"
    command = [sys.executable, "-m", "benchmarks", "serve", "--quick", "--model", str(tiny_model_dirs["gqa"])]
    command += ["--threads", "1", "--json", str(json_path), "--figure", str(figure)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(json_path.read_text())
    assert figure.stat().st_size > 0 and result["correct"] is True and result["quick"] is True
    assert result["command"].startswith("python -m benchmarks serve") and "--json" not in result["command"]

    s = result["settings"]
    [server] = result["servers"]
    assert server["server"] == "rosellm" and "error" not in server and server["load_s"] > 0
    pid = server["pid"]
    assert pid > 0 and server["exit_status"] is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert process_group_members(pid) == []  # nothing the server started either

    assert [r["rate"] for r in result["runs"]] == s["rates"] and result["agreement"] == {}  # no peer to compare
    for r in result["runs"]:
        assert r["server"] == "rosellm" and r["requests"] == r["completed"] == s["requests"] and r["failed"] == 0
        assert "errors" not in r and "texts" not in r and len(r["request_details"]) == s["requests"]
        for request in r["request_details"]:
            assert request["tokens"] == request["max_tokens"] and request["chunks"] >= 1
            assert s["prompt_len"][0] <= request["prompt_len"] <= s["prompt_len"][1]
        assert r["output_tokens"] == sum(d["max_tokens"] for d in r["request_details"])
        for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            p50, p90, p99 = (r[key][q] for q in ("p50", "p90", "p99"))
            assert 0 < p50 <= p90 <= p99, (key, r[key])
        assert r["ttft_s"]["p99"] <= r["e2e_s"]["p99"] and r["duration_s"] > 0
        assert r["request_throughput"] > 0 and r["output_tokens_per_s"] > 0
        assert 0 <= r["goodput"] <= 1 and 0 <= r["goodput_rps"] <= r["request_throughput"]


@pytest.mark.workload("serve")
def test_serve_quick_runs_chapter_16_forms_and_leaves_no_core(tiny_model_dirs, tmp_path):
    json_path, figure = tmp_path / "result.json", tmp_path / "figure.png"
    command = [sys.executable, "-m", "benchmarks", "serve", "--quick", "--model", str(tiny_model_dirs["gqa"])]
    command += [
        "--rosellm",
        "split,dp2",  # in-process is the default form, run by the other quick tests
        "--threads",
        "2",
        "--json",
        str(json_path),
        "--figure",
        str(figure),
    ]
    uncompiled = dict(os.environ, TORCH_COMPILE_DISABLE="1")  # no speed is read here: three engines start eager
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=uncompiled)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(json_path.read_text())
    assert figure.stat().st_size > 0 and result["correct"] is True
    assert "offline decode step, batch 1" in done.stdout and "TPOT p50 / offline step" in done.stdout

    s, names = result["settings"], ["rosellm-split", "rosellm-dp2"]
    assert s["rosellm"] == ["split", "dp2"]
    assert [server["server"] for server in result["servers"]] == names
    assert len({server["label"] for server in result["servers"]}) == 2
    for server in result["servers"]:
        assert "error" not in server and server["exit_status"] is not None
        with pytest.raises(ProcessLookupError):
            os.kill(server["pid"], 0)
        assert process_group_members(server["pid"]) == []  # its engine cores too

    assert result["offline_step_ms"] > 0 and result["offline_step"]["max_tokens"] == s["max_tokens"][1]
    assert result["offline_steps_ms"] == {"1": result["offline_step_ms"]}  # quick: one row only
    for server in result["servers"]:  # requests one after another, before the rates
        assert server["alone_failed"] == 0 and server["tpot_alone_ms"] > 0
        ratio = server["tpot_alone_ms"] / result["offline_step_ms"]
        assert server["alone_over_offline_step"] == pytest.approx(ratio, 1e-2)
    assert "requests one after another" in done.stdout
    assert [(r["server"], r["rate"]) for r in result["runs"]] == [(n, rate) for n in names for rate in s["rates"]]
    for r in result["runs"]:
        assert r["requests"] == r["completed"] == s["requests"] and r["failed"] == 0
        assert r["tpot_over_offline_step"] == pytest.approx(1000 * r["tpot_s"]["p50"] / result["offline_step_ms"], 1e-2)
        assert 0 < r["engine_step_ms"] < 1000 * r["duration_s"]  # the server's own timing of its steps
    agreement = result["agreement"]
    assert sorted(agreement) == ["rosellm-split vs rosellm-dp2"]
    for rates in agreement.values():
        assert [a["rate"] for a in rates] == s["rates"]
        assert all(a["identical"] == a["requests"] == s["requests"] for a in rates)
