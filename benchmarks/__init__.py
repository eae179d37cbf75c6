"""The benchmark harness: `python -m benchmarks <workload> [options]`.

Each workload is a module with `HELP` (one line), `add_arguments(parser)` and `run(args)`. To add one,
write the module and add a line to `WORKLOADS`; `__main__` imports only the workload a command names.
"""

WORKLOADS = {
    # command name -> module under benchmarks/
    "decode-scaling": "benchmarks.decode_scaling",
    "paged-vs-padded": "benchmarks.paged_vs_padded",
    "batch-throughput": "benchmarks.batch_throughput",
    "arrivals": "benchmarks.arrivals",
    "offline-cpu": "benchmarks.offline_cpu",
    "latency-cpu": "benchmarks.latency_cpu",
    "chapters": "benchmarks.chapter_progress",
    "offline-gpu": "benchmarks.offline_gpu",
}
