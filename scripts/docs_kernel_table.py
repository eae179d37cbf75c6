"""mkdocs hook: the compile facts of chapter 06's kernels as tables, generated at build time.

A line of its own in a page

    <!-- kernel-compile-table -->

is replaced by one folded table per kernel, made from benchmarks/results/kernel_compile.json (written by
`python -m benchmarks.kernel_compile`): a row per configuration, sm_80 and sm_90 side by side.
"""

import json
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^<!--\s*kernel-compile-table\s*-->[ \t]*$", re.MULTILINE)
RESULTS = Path("benchmarks") / "results" / "kernel_compile.json"
ARCHS = ("sm_80", "sm_90")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if not MARKER.search(markdown):
        return markdown
    path = Path(config.config_file_path).parent / RESULTS
    if not path.is_file():
        raise PluginError(f"{page.file.src_path}: {RESULTS} is missing: run python -m benchmarks.kernel_compile")
    tables = kernel_tables(json.loads(path.read_text())["rows"])
    return MARKER.sub(lambda _: tables, markdown)


def kernel_tables(rows: list[dict]) -> str:
    """One collapsible block per kernel, in the order the rows first name them."""
    by_kernel = {}
    for row in rows:
        by_kernel.setdefault(row["kernel"], []).append(row)
    return "\n".join(kernel_table(kernel, kernel_rows) for kernel, kernel_rows in by_kernel.items())


def kernel_table(kernel: str, rows: list[dict]) -> str:
    """A folded Markdown table of one kernel's configurations, its largest costs in the title."""
    configurations = {}  # everything but the architecture -> {arch: row}
    for row in rows:
        key = (row["dtype"], row["head_dim"], json.dumps(row["constexprs"]))
        configurations.setdefault(key, {})[row["arch"]] = row
    most_shared = max(row["shared_bytes"] for row in rows) / 1024
    most_registers = max(row["registers"] for row in rows)
    title = (
        f"`{kernel}`: {len(configurations)} configurations, at most {most_shared:.1f} KiB of shared memory "
        f"and {most_registers} registers per thread"
    )
    lines = [
        f'??? note "{title}"',
        "",
        "    | dtype | head_dim | constexprs | warps | stages | shared KiB sm_80 / sm_90 "
        "| registers sm_80 / sm_90 | stack bytes (spills) sm_80 / sm_90 | PTX KiB sm_80 / sm_90 |",
        "    | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (dtype, head_dim, _), by_arch in configurations.items():
        first = by_arch[ARCHS[0]]
        constexprs = ", ".join(f"{name}={value}" for name, value in first["constexprs"].items())
        lines.append(
            f"    | {dtype} | {head_dim} | `{constexprs}` | {first['num_warps']} | {first['num_stages']} "
            f"| {per_arch(by_arch, 'shared_bytes', 1024, '.1f')} | {per_arch(by_arch, 'registers')} "
            f"| {per_arch(by_arch, 'stack_bytes')} | {per_arch(by_arch, 'ptx_bytes', 1024)} |"
        )
    return "\n".join(lines) + "\n"


def per_arch(by_arch: dict, field: str, scale: int = 1, spec: str = ".0f") -> str:
    """A field of each architecture's row, e.g. "12.5 / 16.0"."""
    return " / ".join(format(by_arch[arch][field] / scale, spec) for arch in ARCHS)
