"""The seams between the folders: the `LLM` asks its engine, stats cross as counts, the draft proposer frees
through the block manager, the model names no attention backend."""

import ast
import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from chapters import submodule

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.requires("subpackages")


def imports_of(checkpoint_info, module: str) -> set[str]:
    spec = importlib.util.spec_from_file_location("import_layers", ROOT / "scripts" / "import_layers.py")
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    return layers.import_graph(checkpoint_info.path)[checkpoint_info.module_path(module)]


def test_stats_are_a_snapshot_of_counts_that_neither_the_protocol_nor_the_metrics_import_from_the_engine(
    checkpoint, checkpoint_info
):
    for module in ("core_protocol", "metrics"):
        assert checkpoint_info.module_path("llm_engine") not in imports_of(checkpoint_info, module)
    stats = submodule(checkpoint, "core_protocol").StepOutputs.__annotations__["stats"]
    assert stats is submodule(checkpoint, "metrics").EngineStats  # the metrics' own snapshot type
    fields = {field.name: field.type for field in dataclasses.fields(stats)}
    assert fields["num_running_requests"] is int and fields["num_waiting_requests"] is int  # counts, not id sets


def test_the_model_names_no_backend(checkpoint_info):
    model = checkpoint_info.path / f"{checkpoint_info.module_path('model').replace('.', '/')}.py"
    compared = [
        side.value
        for node in ast.walk(ast.parse(model.read_text()))
        if isinstance(node, ast.Compare)
        for side in (node.left, *node.comparators)
        if isinstance(side, ast.Constant)
    ]
    assert not set(compared) & {"cpu", "torch", "triton", "reference"}  # no `backend.name == "cpu"`
    assert not any(".backends." in target for target in imports_of(checkpoint_info, "model"))


def test_the_draft_proposer_frees_through_the_block_manager(checkpoint_info):
    source = checkpoint_info.path / f"{checkpoint_info.module_path('draft_proposer').replace('.', '/')}.py"
    reached = [node for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.Attribute)]
    assert not [node for node in reached if node.attr == "allocator"]


def test_shrink_gives_back_the_blocks_past_a_length(checkpoint):
    manager = checkpoint.block_manager.BlockManager(num_blocks=8, block_size=4)

    record = SimpleNamespace(block_table=[])  # a draft model's record: a block table, no sequence
    manager.grow(record, 13)  # 4 blocks
    assert len(record.block_table) == 4 and manager.num_free_blocks == 4
    manager.shrink(record, 5)  # 2 blocks hold 5 slots
    assert len(record.block_table) == 2 and manager.num_free_blocks == 6


def test_the_llm_reads_its_engine_and_asks_it_whether_a_request_is_done(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), enforce_eager=True, num_kv_blocks=16, block_size=4)
    engine = llm.llm_engine
    assert (llm.model, llm.tokenizer, llm.block_manager) == (engine.model, engine.tokenizer, engine.block_manager)
    original, engine.block_manager = engine.block_manager, object()  # read from the engine each time, not copied
    assert llm.block_manager is engine.block_manager is not original
    engine.block_manager = original
    asked = []
    unfinished = engine.is_unfinished
    engine.is_unfinished = lambda request_id: asked.append(request_id) or unfinished(request_id)
    stream = llm.stream([1, 2, 3], checkpoint.SamplingParams(temperature=0, max_tokens=3))
    pieces = list(stream)
    assert asked and set(asked) == {asked[0]} and not unfinished(asked[0]) and isinstance(pieces, list)
