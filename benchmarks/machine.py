"""What a result was measured on: recorded in every result file, because numbers without a machine
mean little."""

import os
import platform
import sys
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: str = "cpu") -> dict:
    import torch

    info = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
        # other work on the machine distorts timings: the 1-minute load average when this was called
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if str(device).startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


class OtherLoad:
    """Measures how much CPU *other* processes used while a benchmark ran (Linux only; None elsewhere).

    A shared machine makes timings meaningless without saying so: this goes into every result file.
    """

    def __enter__(self):
        self.start = self._sample()
        return self

    def __exit__(self, *exc):
        self.end = self._sample()

    @staticmethod
    def _sample():
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except OSError:
            return None
        idle = fields[3] + fields[4]  # idle + iowait, in clock ticks summed over all CPUs
        ticks = os.sysconf("SC_CLK_TCK")
        own = os.times()
        return sum(fields) / ticks, (sum(fields) - idle) / ticks, own.user + own.system

    @property
    def share(self) -> float | None:
        """CPU time used by other processes, as a share of all CPUs' time during the run."""
        if self.start is None or self.end is None:
            return None
        total, busy, own = (end - start for end, start in zip(self.end, self.start))
        return round(max(busy - own, 0.0) / total, 3) if total > 0 else None


def command_line(argv: list[str] | None = None) -> str:
    """The command that reproduces a run, without the output paths (they do not change what is measured)."""
    kept, skip = [], False
    for arg in sys.argv[1:] if argv is None else argv:
        if skip:
            skip = False
        elif arg in ("--json", "--figure"):
            skip = True
        elif not arg.startswith(("--json=", "--figure=")):
            kept.append(arg)
    return "python -m benchmarks " + " ".join(kept)


def measure_watched(args, measure) -> dict:
    """`measure(args)` with torch's threads set from `--threads`, recording (and warning about) the share of
    the CPU other processes used meanwhile."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with OtherLoad() as other:
        result = measure(args)
    result["machine"]["other_processes_cpu_share"] = other.share
    if other.share and other.share > 0.05:
        print(f"warning: other processes used {other.share:.0%} of the CPU during the run; "
              f"the timings are disturbed")
    return result
