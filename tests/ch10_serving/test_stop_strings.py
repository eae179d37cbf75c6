"""Stop strings: matched on the detokenized text (across token boundaries), the text ends before the stop string,
text already released is never taken back, and the sequence's blocks are freed at once; offline `LLM` included."""

import pytest

from tests.ch10_serving.conftest import module_of, spanning_stop, token_ends

pytestmark = pytest.mark.requires("serving")

PROMPT = "An inference engine turns a prompt into tokens"


def released(checkpoint, stop: list[str], pieces: list[str], final_at: int | None = None) -> tuple[list[str], bool]:
    matcher = module_of(checkpoint, "stop_strings").StopStringMatcher(stop)
    out = [matcher.add(piece, final=i == final_at) for i, piece in enumerate(pieces)]
    return out, matcher.stopped


def test_a_stop_string_spanning_pieces_is_held_back_then_dropped(checkpoint):
    out, stopped = released(checkpoint, ["\n\nUser:"], ["Hel", "lo\n", "\nUs", "er", ": more", "never"])
    assert out == ["Hel", "lo", "", "", "", ""] and stopped


def test_a_false_start_is_released_when_ruled_out(checkpoint):
    out, stopped = released(checkpoint, ["\n\nUser:"], ["a\n", "\nU", "x", "yz"])
    assert out == ["a", "", "\n\nUx", "yz"] and not stopped


def test_the_earliest_stop_string_wins_and_final_releases_everything(checkpoint):
    assert released(checkpoint, ["yy", "xx"], ["a xx yy"]) == (["a "], True)
    assert released(checkpoint, ["xyz"], ["ab", "xy"], final_at=1) == (["ab", "xy"], False)


def test_stop_is_validated_like_the_other_fields(checkpoint):
    assert checkpoint.SamplingParams(stop="ab").stop == ["ab"]
    assert checkpoint.SamplingParams().stop == []
    for bad in ("", [""], [1], ["ok", None], 5):
        with pytest.raises(ValueError, match="stop must be"):
            checkpoint.SamplingParams(stop=bad)


def test_offline_generation_stops_inside_a_token_boundary(checkpoint, offline):
    params = dict(temperature=0, max_tokens=40, ignore_eos=True)
    text, token_ids, lengths = token_ends(offline, PROMPT, checkpoint.SamplingParams(**params))
    stop, end = spanning_stop(text, lengths)
    [output] = offline.generate([PROMPT], checkpoint.SamplingParams(**params, stop=["never there", stop]), False)
    assert output.text == text[: end - 2] and output.finish_reason == "stop"
    # The tokens are those sampled up to the one that completed the stop string.
    completing = next(i for i, length in enumerate(lengths) if length >= end + 2)
    assert output.token_ids == token_ids[: completing + 1]
    assert offline.block_manager.num_free_blocks == offline.block_manager.num_total_blocks


def test_text_only_grows_and_every_sample_stops_alone(checkpoint, offline):
    """With n = 2 seeded samples, each stops at its own stop string; every step's text extends the last one."""
    params = dict(temperature=1.0, max_tokens=30, ignore_eos=True, seed=5, n=2)
    [free] = offline.generate([PROMPT], checkpoint.SamplingParams(**params), use_tqdm=False)
    stop = free.outputs[1].text[10:13]
    engine = offline.llm_engine
    engine.add_request("stops", PROMPT, checkpoint.SamplingParams(**params, stop=stop))
    texts = {0: "", 1: ""}
    while engine.has_unfinished_requests():
        for output in engine.step():
            for answer in output.outputs:
                assert answer.text.startswith(texts[answer.index])
                texts[answer.index] = answer.text
    for answer, unstopped in zip(output.outputs, free.outputs):
        cut = unstopped.text.find(stop)
        assert answer.text == (unstopped.text if cut < 0 else unstopped.text[:cut])
        assert answer.finish_reason == ("length" if cut < 0 else "stop")
    assert output.outputs[1].finish_reason == "stop"
    assert offline.block_manager.num_free_blocks == offline.block_manager.num_total_blocks
