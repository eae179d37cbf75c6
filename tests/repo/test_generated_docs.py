"""The parts of the book made from the repository: where a chapter's code is, the chapter lists of the home
page and the README, and the values quoted from result files."""

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from mkdocs.exceptions import PluginError

import chapters

pytestmark = pytest.mark.repo

ROOT = Path(__file__).resolve().parents[2]


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


docs_hooks, docs_results, chapter_list = script("docs_hooks"), script("docs_results"), script("chapter_list")


def render(hook, text: str, root: Path = ROOT, src_path: str = "page.md") -> str:
    config = SimpleNamespace(config_file_path=str(root / "mkdocs.yml"))
    return hook.on_page_markdown(text, SimpleNamespace(file=SimpleNamespace(src_path=src_path)), config, None)


# --- where the code is ----------------------------------------------------------------------------------


def test_only_the_latest_chapter_says_its_code_is_rosellm():
    points = chapters.checkpoints()
    *older, latest = points
    sentence = docs_hooks.code_location(points, latest.name)
    assert sentence.startswith("This chapter's code is `rosellm/`, the latest checkpoint;")
    assert f"`chapters/{older[-1].name}/rosellm/`" in sentence
    for point in older:
        sentence = docs_hooks.code_location(points, point.name)
        assert sentence.startswith(f"This chapter's code is frozen in `chapters/{point.name}/rosellm/`")
        assert f"at git tag `ch{point.number:02d}`" in sentence
        assert f"the latest checkpoint, chapter {latest.number:02d}'s, is `rosellm/`" in sentence


def test_a_new_chapter_turns_the_page_of_the_old_latest_to_its_frozen_copy():
    points = chapters.checkpoints()
    old = points[-1]
    frozen = dataclasses.replace(old, module=f"chapters.{old.name}.rosellm", path=ROOT / "chapters" / old.name)
    new = dataclasses.replace(old, number=old.number + 1, slug="next", name=f"ch{old.number + 1:02d}_next")
    after = [*points[:-1], frozen, new]
    assert "`rosellm/`, the latest checkpoint" not in docs_hooks.code_location(after, old.name)
    assert docs_hooks.code_location(after, old.name).startswith(
        f"This chapter's code is frozen in `chapters/{old.name}/"
    )
    assert docs_hooks.code_location(after, new.name) == (
        f"This chapter's code is `rosellm/`, the latest checkpoint; chapter {old.number:02d} is frozen in "
        f"`chapters/{old.name}/rosellm/`."
    )


def test_a_marker_naming_no_chapter_fails_the_build():
    with pytest.raises(PluginError, match="ch99_nothing"):
        render(docs_hooks, '!!! note "Where the code is"\n    <!-- code-location: ch99_nothing -->\n')


def test_a_move_into_subpackages_is_diffed_as_renames(tmp_path):
    """From a flat checkpoint to one with `__modules__`: a moved file is paired with its new path, "moved" when
    it did not change (a row, no fold), "moved, changed" with only the changed lines, as `git diff -M`."""
    flat, nested = tmp_path / "flat", tmp_path / "nested"
    (flat).mkdir()
    (nested / "core").mkdir(parents=True)
    (flat / "scheduler.py").write_text("A = 1\n")
    (flat / "loader.py").write_text("from .scheduler import A\nB = 2\n")
    (nested / "core" / "scheduler.py").write_text("A = 1\n")
    (nested / "core" / "loader.py").write_text("from ..core.scheduler import A\nB = 2\n")
    (nested / "core" / "__init__.py").write_text('"""The core."""\n')
    renames = (("loader", "core.loader"), ("scheduler", "core.scheduler"))
    old = chapters.Checkpoint(1, "flat", "ch01_flat", "x", flat, frozenset())
    new = chapters.Checkpoint(2, "nested", "ch02_nested", "y", nested, frozenset(), renames)
    old_files, new_files = docs_hooks.checkpoint_files(flat), docs_hooks.checkpoint_files(nested)
    assert docs_hooks.paired_paths(old, new, old_files, new_files) == [
        (None, "core/__init__.py"),
        ("loader.py", "core/loader.py"),
        ("scheduler.py", "core/scheduler.py"),
    ]
    page = docs_hooks.chapter_diff(ROOT, "ch16_engine_core", "ch17_layout")
    assert "| `rosellm/scheduler.py` → `rosellm/core/scheduler.py` | moved | +0 | −0 |" in page
    assert (
        "[`rosellm/llm_engine.py` → `rosellm/engine/llm_engine.py`](#diff-engine-llm-engine-py) | moved, changed"
        in page
    )
    fold = page[page.index('id="diff-engine-llm-engine-py"') :].split("</details>")[0]
    assert (
        "-from .block_manager import BlockManager" in fold and "+from ..core.block_manager import BlockManager" in fold
    )
    assert "def step(" not in fold  # the lines that changed, not the whole file again


@pytest.mark.parametrize("point", chapters.checkpoints(), ids=lambda point: point.name)
def test_each_chapter_page_opens_its_note_with_its_own_marker(point):
    text = (ROOT / "docs" / "chapters" / f"{point.name}.md").read_text()
    assert re.findall(r"<!-- code-location: (\w+) -->", text) == [point.name]
    assert f'!!! note "Where the code is"\n    <!-- code-location: {point.name} -->\n' in text
    assert "This chapter's code is" not in text  # written by the hook only
    shown = render(docs_hooks, text.split("## ")[0])  # the page up to its first section, diffs aside
    assert f"    {docs_hooks.code_location(chapters.checkpoints(), point.name)}\n" in shown


# --- the chapter lists ------------------------------------------------------------------------------------


def test_the_home_page_lists_every_checkpoint_with_its_page_title():
    shown = render(docs_hooks, (ROOT / "docs" / "index.md").read_text())
    assert "<!-- chapter-list -->" not in shown
    for point in chapters.checkpoints():
        title = chapter_list.page_title(ROOT, point.name)
        learn, can = chapter_list.SUMMARIES[point.name]
        assert f"| {point.number:02d} | [{title}](chapters/{point.name}.md) | {learn} | {can} |" in shown


def test_a_checkpoint_without_a_summary_and_a_summary_without_its_checkpoint_are_refused():
    points = chapters.checkpoints()
    extra = dataclasses.replace(points[-1], number=points[-1].number + 1, slug="next", name="ch99_next")
    with pytest.raises(ValueError, match="ch99_next"):
        chapter_list.summaries_for([*points, extra])
    renamed = dataclasses.replace(points[-1], slug="renamed", name=f"ch{points[-1].number:02d}_renamed")
    with pytest.raises(ValueError, match=f"{renamed.name}.*{points[-1].name}"):
        chapter_list.summaries_for([*points[:-1], renamed])


def test_at_a_chapter_tag_the_list_stops_at_that_chapter():
    first_two = chapters.checkpoints()[:2]
    table = chapter_list.chapter_table(ROOT, first_two, "chapters")
    assert len(table.splitlines()) == 2 + 2
    assert chapter_list.summaries_for(first_two) == [chapter_list.SUMMARIES[point.name] for point in first_two]


def test_the_readme_is_up_to_date():
    done = subprocess.run(
        [sys.executable, "scripts/readme.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_the_readme_check_sees_a_stale_chapter_list_and_stale_numbers():
    readme = script("readme")
    text = (ROOT / "README.md").read_text()
    last = chapters.latest()
    title = chapter_list.page_title(ROOT, last.name)
    row = f"| {last.number:02d} | [{title}](docs/chapters/{last.name}.md) |"
    assert row in text
    engines = json.loads((ROOT / "benchmarks" / "results" / "offline_cpu.json").read_text())["engines"]
    ours = next(e for e in engines if e["engine"] == "rosellm")
    quoted = f"| {ours['output_tokens_per_s']:.1f} |"
    assert quoted in text
    for stale in (text.replace(row, "| 99 | [Gone](docs/chapters/gone.md) |"), text.replace(quoted, "| 1.0 |")):
        assert stale != text and readme.filled(stale) == text


# --- values from result files -----------------------------------------------------------------------------


@pytest.fixture
def results_root(tmp_path: Path) -> Path:
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    result = {"engines": [{"tps": 116.3312}, {"tps": 22.34}], "share": 0.302, "tokens": 9588}
    (tmp_path / "benchmarks" / "results" / "r.json").write_text(json.dumps(result))
    return tmp_path


def test_a_value_is_written_mid_sentence_with_its_format(results_root):
    text = (
        "rosellm makes <!-- value: r.json engines.0.tps .1f --> tokens/s, the last "
        "<!-- value: r.json engines.-1.tps --> of <!-- value: r.json tokens ,d --> tokens, under "
        "<!-- value: r.json share .0% --> load."
    )
    assert (
        render(docs_results, text, results_root)
        == "rosellm makes 116.3 tokens/s, the last 22.34 of 9,588 tokens, under 30% load."
    )


def test_a_value_marker_between_backticks_is_shown_as_it_is(results_root):
    text = "write `<!-- value: r.json engines.0.tps .1f -->` where the number goes"
    assert render(docs_results, text, results_root) == text


@pytest.mark.parametrize(
    ("marker", "named"),
    [
        ("<!-- value: r.json engines.0.speed .1f -->", ["r.json", "'speed'"]),
        ("<!-- value: r.json engines.2.tps .1f -->", ["r.json", "'2'"]),
        ("<!-- value: r.json missing -->", ["r.json", "'missing'"]),
        ("<!-- value: other.json tokens -->", ["other.json"]),
        ("<!-- value: r.json tokens .1q -->", ["r.json", "tokens"]),
    ],
)
def test_a_missing_key_or_file_fails_the_build_naming_them(results_root, marker, named):
    with pytest.raises(PluginError) as failure:
        render(docs_results, f"It made {marker} tokens/s.", results_root, src_path="setup.md")
    assert all(word in str(failure.value) for word in ["setup.md", *named])


def two_runs(root: Path, same_run: bool = False) -> Path:
    """a.json and b.json measured on two days; `same_run`: as one group run of `python -m benchmarks results`."""
    for name, date in (("a.json", "2026-11-26"), ("b.json", "2026-11-27")):
        result = {"date": date, "machine": {"cpu": "AMD EPYC"}, "ms": 18.04 if name == "a.json" else 34.5}
        if same_run:
            result["run"] = {"id": "cpu-2026-11-26-0123abc", "group": "cpu"}
        (root / "benchmarks" / "results" / name).write_text(json.dumps(result))
    return root


MIXED = "## Batch 1\n\nOurs <!-- value: a.json ms .1f --> ms, theirs <!-- value: b.json ms .1f --> ms.\n"


def test_a_section_quoting_two_runs_fails_the_build_naming_them(results_root):
    with pytest.raises(PluginError) as failure:
        render(docs_results, "# Page\n\n" + MIXED, two_runs(results_root), src_path="ch14.md")
    assert all(word in str(failure.value) for word in ["ch14.md", "'Batch 1'", "a.json (2026-11-26", "b.json (2026"])


def test_two_sections_may_quote_a_run_each_and_one_run_may_span_two_days(results_root):
    text = "## A\n\n<!-- value: a.json ms .1f --> ms\n\n## B\n\n<!-- value: b.json ms .1f --> ms\n"
    assert render(docs_results, text, two_runs(results_root)) == "## A\n\n18.0 ms\n\n## B\n\n34.5 ms\n"
    one_run = two_runs(results_root, same_run=True)
    assert render(docs_results, MIXED, one_run).endswith("Ours 18.0 ms, theirs 34.5 ms.\n")


def test_a_heading_inside_a_code_fence_does_not_start_a_section(results_root):
    text = "## A\n\n```\n# a comment\n```\n<!-- value: a.json ms .1f --> and <!-- value: b.json ms .1f -->\n"
    with pytest.raises(PluginError, match="'A'"):
        render(docs_results, text, two_runs(results_root))


def test_a_labelled_section_letters_each_number_with_its_run(results_root):
    text = MIXED.replace("\n\n", "\n\n<!-- runs: labelled -->\n\n", 1)
    shown = render(docs_results, text, two_runs(results_root))
    assert "Ours 18.0<sup>A</sup> ms, theirs 34.5<sup>B</sup> ms." in shown
    assert shown.endswith(
        "*Runs: <sup>A</sup> a.json: 2026-11-26, on AMD EPYC; <sup>B</sup> b.json: 2026-11-27, on AMD EPYC.*\n\n"
    )
    assert "runs: labelled" not in shown


@pytest.mark.parametrize("page", ["index.md", "setup.md"])
def test_the_home_and_setup_pages_quote_result_files(page):
    text = (ROOT / "docs" / page).read_text()
    assert "<!-- value: " in text
    assert "<!-- value: " not in render(docs_results, text)


def test_the_serve_block_states_the_load_the_run_recorded():
    result = json.loads((ROOT / "benchmarks" / "results" / "serve.json").read_text())
    shown = docs_results.block_serve(ROOT / "benchmarks" / "results", "serve.json")
    assert f"other processes used {100 * result['other_processes_cpu_share']:.0f} % of the CPU meanwhile" in shown


def test_the_serve_block_takes_a_token_apart_where_the_run_measured_it():
    """Chapter 16's run times requests one after another and the offline step at several rows: a table of
    them; chapter 10's run did neither, and its block has none."""
    result = json.loads((ROOT / "benchmarks" / "results" / "serve_ch16.json").read_text())
    shown = docs_results.block_serve(ROOT / "benchmarks" / "results", "serve_ch16.json")
    for server in result["servers"]:
        assert (
            f"| {server['label']} | {server['tpot_alone_ms']:.1f} | {server['alone_over_offline_step']:.2f}× |" in shown
        )
    together = " / ".join(f"{ms:.1f}" for ms in result["offline_steps_ms"].values())
    assert f"with 1 / 2 / 4 requests decoding together: **{together} ms**" in shown
    assert "requests one after another" not in docs_results.block_serve(ROOT / "benchmarks" / "results", "serve.json")


def test_every_result_file_is_remeasured_by_one_job_of_the_results_command():
    from benchmarks import book_results

    made = [job.file for jobs in book_results.groups().values() for job in jobs]
    assert len(made) == len(set(made))
    pages = [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    quoted = {name for page in pages for name in docs_results.quoted_files(page.read_text())}
    committed = {path.name for path in (ROOT / "benchmarks" / "results").glob("*.json")}
    not_timed = {"kernel_compile.json"}  # the Triton kernels' compiled shapes, written by benchmarks.kernel_compile
    assert quoted <= set(made) and committed - not_timed == set(made)
