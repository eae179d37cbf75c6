"""`python -m benchmarks results`: re-measure every result file the book quotes, one group at a time.

A group is one run: its workloads run one after another in this process's children, on one machine, and each
file they write carries the run's id (`"run": {"id": ..., "group": ...}`), so that the book's results hook can
tell numbers of one run from numbers of two (scripts/docs_results.py). The run's manifest,
`benchmarks/results/runs/GROUP.json`, says what ran where: the commit, the day, the CPU's model and every flag
lscpu prints, the memory bandwidth and GEMM rate measured before and after, the load, each file's time.

All groups take about three hours on 2 cores (the sum of the committed files' times), too long to hold a
machine idle, so the book is measured in groups that each fit in about an hour and a half, each page quoting
one group (a page that quotes two labels its numbers with their runs):

    foundations   chapters 01-10: the decode loop to the server, rosellm alone
    cpu           chapters 11-13: the CPU fast path, tensor parallelism, weight formats; vLLM and llama.cpp
    features      chapters 14-18: the latest engine at batch 1, speculation, grammars, the split server;
                  chapter 18's kernels at three CPU levels; vLLM
    avx2-cpu      chapter 18 on a CPU with AVX2 and no AVX-512 (refused on any other): batch 1 beside
                  llama.cpp, and its kernels

`--list` prints the groups, their files and how long each took when it was last measured. The peers a group
needs are installed before its run starts (once: llama.cpp compiles for about 15 minutes); `--without-peers`
runs rosellm and transformers alone (its files then lack the peers' rows: not for the book).
"""

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import WORKLOADS, harness, peers

RUN_VARIABLE = "BENCHMARKS_RUN"  # the run's id and group, set for the workloads a group runs (harness.measured)


@dataclasses.dataclass(frozen=True)
class Job:
    file: str  # the result file under benchmarks/results/
    command: str  # `python -m benchmarks` + this (no output paths)
    figure: str | None = None  # docs/figures/FIGURE when a page shows it; None: its figure is not kept
    cpu_level: str | None = None  # ROSELLM_CPU_FEATURES for the workload: the kernels of a lower CPU level

    def argv(self, results: Path, scratch: Path, quick: bool, without_peers: bool, model: str | None) -> list[str]:
        words = shlex.split(self.command) + (["--model", model] if model else [])
        if without_peers and "--peers" in words:
            at = words.index("--peers")
            del words[at : at + 2]
        figure = harness.FIGURES / self.figure if self.figure and not quick else scratch / f"{Path(self.file).stem}.png"
        return [*words, "--json", str(results / self.file), "--figure", str(figure), *(["--quick"] if quick else [])]

    @property
    def shell_command(self) -> str:
        """The command as a reader would type it."""
        level = f"ROSELLM_CPU_FEATURES={self.cpu_level} " if self.cpu_level else ""
        return f"{level}python -m benchmarks {self.command}"

    @property
    def workload(self) -> str:
        return self.command.split()[0]

    @property
    def peers(self) -> list[str]:
        words = shlex.split(self.command)
        return words[words.index("--peers") + 1].split(",") if "--peers" in words else []


# chapter 18's kernels at every row count its thresholds (PLAIN_ROWS, INTEGER_DOT_ROWS) lie between, per CPU level
KERNEL_CHOICE = "quant-kernels --checkpoint 18 --rows 1,2,3,4,8,16,32,64"
GROUPS = {
    "foundations": [
        Job("decode_scaling_ch01.json", "decode-scaling --checkpoint 1", "decode_scaling_ch01.png"),
        Job("ch02_decode_scaling_ch01.json", "decode-scaling --checkpoint 1 --threads 1 --steps 16"),
        Job("ch02_decode_scaling_ch02.json", "decode-scaling --checkpoint 2 --threads 1 --steps 16"),
        Job("batch_throughput_ch03.json", "batch-throughput --threads 1", "ch03_batch_throughput.png"),
        Job("ch03_padding.json", "batch-throughput --padding --threads 1"),
        Job("paged_vs_padded.json", "paged-vs-padded --threads 1", "paged_vs_padded.png"),
        Job("arrivals.json", "arrivals --threads 1", "arrivals.png"),
        Job("long_prompts.json", "long-prompts --threads 2", "ch08_long_prompts.png"),
        Job("prefix.json", "prefix --threads 2", "ch09_prefix.png"),
        Job("serve.json", "serve --peers vllm", "ch10_serve.png"),
        Job("chapters.json", "chapters", "throughput_per_chapter.png"),
    ],
    "cpu": [
        Job("cpu_ablation.json", "cpu-ablation", "ch11_ablation.png"),
        Job("offline_cpu.json", "offline-cpu --checkpoint 11 --peers vllm,llamacpp", "offline_cpu.png"),
        Job(
            "offline_cpu_bf16.json",
            "offline-cpu --checkpoint 16 --dtype bfloat16 --engines rosellm --peers vllm",
            "offline_cpu_bf16.png",
        ),
        Job("latency_cpu_ch11.json", "latency-cpu --checkpoint 11 --peers vllm,llamacpp"),
        Job("latency_cpu_ch12.json", "latency-cpu --checkpoint 12 --engines rosellm"),
        Job("tensor_parallel.json", "tensor-parallel", "ch12_tensor_parallel.png"),
        Job("latency_cpu_ch13.json", "latency-cpu --checkpoint 13 --peers vllm,vllm-bf16,llamacpp,llamacpp-q4_1"),
        Job("quant_kernels.json", "quant-kernels", "ch13_quant_kernels.png"),
        Job("perplexity.json", "perplexity", "ch13_perplexity.png"),
    ],
    "features": [
        Job(
            "latency_cpu.json",
            "latency-cpu --checkpoint 16 --peers vllm,vllm-bf16,llamacpp,llamacpp-q4_1",
            "latency_cpu.png",
        ),
        Job("speculative.json", "speculative --peers vllm", "ch14_speculative.png"),
        Job("structured.json", "structured --peers vllm", "ch15_structured.png"),
        Job(
            "serve_ch16.json",
            "serve --rosellm in-process,split,dp2 --peers vllm --rates 0.25,0.5,1,2 --clients 64",
            "ch16_serve.png",
        ),
        Job(
            "latency_cpu_ch18.json",
            "latency-cpu --variants fp32,gguf,gguf-fp32,bf16 --peers llamacpp,llamacpp-q4_1",
        ),
        Job(
            "latency_cpu_ch18_avx2.json",
            "latency-cpu --variants fp32,gguf,gguf-fp32,bf16 --peers llamacpp-q4_1",
            cpu_level="avx2",
        ),
        Job(
            "latency_cpu_ch18_avx512.json",
            "latency-cpu --variants fp32,gguf,gguf-fp32,bf16 --peers llamacpp-q4_1",
            cpu_level="avx512",
        ),
        Job("offline_cpu_ch18.json", "offline-cpu --checkpoint 18 --engines rosellm --peers vllm"),
        Job(
            "offline_cpu_ch18_bf16.json",
            "offline-cpu --checkpoint 18 --dtype bfloat16 --engines rosellm --peers vllm",
        ),
        Job(
            "perplexity_ch18.json",
            "perplexity --checkpoint 18 --variants fp32,gguf-fp32,gguf-exact --integer-dot-rows 100000",
        ),
        Job(
            "speculative_ch18.json",
            "speculative --checkpoint 18 --batch 1 --requests 4 --sets copy,chat,random "
            "--methods none,ngram,ngram-fixed,draft_model",
        ),
        Job("quant_kernels_ch18.json", KERNEL_CHOICE),
        Job("quant_kernels_ch18_avx2.json", KERNEL_CHOICE, cpu_level="avx2"),
        Job("quant_kernels_ch18_avx512.json", KERNEL_CHOICE, cpu_level="avx512"),
    ],
    "avx2-cpu": [
        Job(
            "latency_cpu_ch18_avx2_cpu.json",
            "latency-cpu --checkpoint 18 --variants fp32,gguf-fp32,bf16 --peers llamacpp,llamacpp-q4_1",
        ),
        Job("quant_kernels_ch18_avx2_cpu.json", KERNEL_CHOICE),
    ],
}


@dataclasses.dataclass(frozen=True)
class Cpu:
    """The kind of CPU a group measures: its files' names say so, so its run refuses any other."""

    says: str
    needs: frozenset[str]  # lscpu flags it must have
    lacks: frozenset[str]  # and must not

    def fits(self, flags: set[str]) -> bool:
        return self.needs <= flags and not self.lacks & flags


GROUP_CPUS = {"avx2-cpu": Cpu("AVX2 and no AVX-512", frozenset({"avx2"}), frozenset({"avx512f"}))}


def other_cpu(name: str) -> str | None:
    """Why group `name` cannot be measured here (it measures another kind of CPU), or None."""
    cpu, flags = GROUP_CPUS.get(name), set((lscpu()["flags"] or "").split())
    if cpu and not cpu.fits(flags):
        return f"the {name} group measures a CPU with {cpu.says}; this one is {lscpu()['model_name']}"
    return None


def groups() -> dict[str, list[Job]]:
    """`GROUPS` without the jobs whose workload this tree does not hold (a chapter's tag holds its own)."""
    return {name: [job for job in jobs if job.workload in WORKLOADS] for name, jobs in GROUPS.items()}


def last_wall_s(job: Job, results: Path = harness.RESULTS) -> float | None:
    """How long the job's committed file took to measure (None when there is none)."""
    path = results / job.file
    return json.loads(path.read_text()).get("wall_s") if path.is_file() else None


def describe_groups() -> str:
    lines = []
    for name, jobs in groups().items():
        times = [last_wall_s(job) for job in jobs]
        total = sum(t for t in times if t)
        lines.append(f"{name}: {len(jobs)} files, {total / 60:.0f} min when last measured")
        lines += [f"  {job.file:32} {t or 0:7.0f} s  {job.shell_command}" for job, t in zip(jobs, times)]
    return "\n".join(lines)


def install_peers(jobs: list[Job]) -> None:
    for name in sorted({name for job in jobs for name in job.peers}):
        peers.install(peers.PEERS[name])


def lscpu() -> dict:
    """The CPU's model and every flag, as /proc/cpuinfo (what lscpu reads) says them."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    field = lambda key: next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), None)  # noqa: E731
    return {"model_name": field("model name"), "flags": field("flags")}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=harness.ROOT, capture_output=True, text=True).stdout.strip()


def run_group(name: str, jobs: list[Job], args) -> dict:
    """Run `jobs` as one run; write and return its manifest (results/runs/NAME.json)."""
    commit, started = git("rev-parse", "HEAD"), datetime.datetime.now().astimezone()
    run = {"id": f"{name}-{started:%Y-%m-%dT%H%M}-{commit[:7]}", "group": name}
    manifest = dict(run=run, commit=commit, uncommitted_changes=bool(git("status", "--porcelain")), quick=args.quick)
    manifest |= dict(started=started.isoformat(timespec="seconds"), lscpu=lscpu(), machine=harness.describe_machine())
    manifest |= dict(rates_before=harness.measure_rates(args.quick), jobs=[])
    path = args.results / "runs" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    env = os.environ | {RUN_VARIABLE: json.dumps(run)}
    with tempfile.TemporaryDirectory() as scratch, harness.OtherLoad() as other:
        for job in jobs:
            argv = job.argv(args.results, Path(scratch), args.quick, args.without_peers, args.model)
            print(f"[{run['id']}] python -m benchmarks {shlex.join(argv)}", flush=True)
            begun = time.perf_counter()
            job_env = env | ({"ROSELLM_CPU_FEATURES": job.cpu_level} if job.cpu_level else {})
            status = subprocess.run(
                [sys.executable, "-m", "benchmarks", *argv], cwd=harness.ROOT, env=job_env
            ).returncode
            manifest["jobs"].append(dict(file=job.file, status=status, wall_s=round(time.perf_counter() - begun, 1)))
            path.write_text(json.dumps(manifest, indent=2) + "\n")  # what ran so far, should a later job fail
            if status:
                raise SystemExit(f"{job.file}: `python -m benchmarks {job.command}` failed (status {status})")
    manifest |= dict(rates_after=harness.measure_rates(args.quick), other_processes_cpu_share=other.share)
    manifest |= dict(load_average_1min_after=round(os.getloadavg()[0], 2))
    manifest["wall_s"] = round(sum(job["wall_s"] for job in manifest["jobs"]), 1)
    path.write_text(json.dumps(harness.portable(manifest), indent=2) + "\n")
    print(f"wrote {path}: {len(jobs)} files in {manifest['wall_s'] / 60:.0f} min")
    return manifest


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks results", description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", choices=list(GROUPS), action="append", help="default: every group, in turn")
    parser.add_argument("--only", nargs="+", default=None, help="of the groups' files, these alone")
    parser.add_argument("--list", action="store_true", help="the groups and their files, measuring nothing")
    parser.add_argument("--quick", action="store_true", help="each workload's --quick run (checks the command)")
    parser.add_argument("--results", type=Path, default=harness.RESULTS, help="where the files go")
    parser.add_argument("--without-peers", action="store_true", help="rosellm and transformers alone")
    parser.add_argument("--model", default=None, help="another model for every workload (not for the book)")
    args = parser.parse_args(argv)
    if args.list:
        print(describe_groups())
        return
    names = args.group or list(GROUPS)
    refused = {name: why for name in names if (why := other_cpu(name))}
    if args.group and refused:
        raise SystemExit("; ".join(refused.values()))
    for why in refused.values():
        print(f"skipped: {why}")
    chosen = {name: groups()[name] for name in names if name not in refused}
    if args.only:
        known = {job.file for jobs in chosen.values() for job in jobs}
        if unknown := sorted(set(args.only) - known):
            parser.error(f"no job of {', '.join(chosen)} writes {', '.join(unknown)}")
        chosen = {name: [job for job in jobs if job.file in args.only] for name, jobs in chosen.items()}
    if not args.without_peers:
        install_peers([job for jobs in chosen.values() for job in jobs])
    for name, jobs in chosen.items():
        if jobs:
            run_group(name, jobs, args)
