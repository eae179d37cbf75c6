"""Graders for the exercises of chapter 18 whose answer is a function or a class (3 and 5; the others change the
engine and are graded by the chapter's own tests and benchmarks, as the page says).

They grade `answers.py` beside this file, or the file `ROSELLM_ANSWERS` names:

    ROSELLM_ANSWERS=path/to/yours.py .venv/bin/python -m pytest tests/ch18_cpu_kernels/test_exercises.py

Each grader is also given a wrong answer, which it must fail: a grader that passes anything grades nothing.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from chapters import submodule
from tests.ch18_cpu_kernels.formats import layers
from tests.ch18_cpu_kernels.test_draft_pace import scripted_run

pytestmark = pytest.mark.requires("integer_dot", "speculative_decoding")


@pytest.fixture(scope="module")
def answers():
    path = Path(os.environ.get("ROSELLM_ANSWERS") or Path(__file__).with_name("answers.py"))
    assert path.is_file(), f"ROSELLM_ANSWERS names no file: {path}"
    spec = importlib.util.spec_from_file_location("chapter_18_answers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Exercise 3: a scale per 16 activations.


def dequantized(quantized, block: int) -> torch.Tensor:
    codes, scales, _ = quantized
    rows = codes.shape[0]
    return (codes.float().reshape(rows, -1, block) * scales[..., None]).reshape(codes.shape)


def grade_quantizer(quantize, integer_dot) -> None:
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))  # [rows, in]
    x[0, 5] = 40.0  # an outlier: with a scale per 32 it coarsens 31 neighbours, per 16 only 15
    x[1, 32:64] = 0.0  # a block of zeros: scale 0, codes 0
    for got, want in zip(quantize(x, 32), integer_dot.quantize_q8_1(x)):  # a block of 32 is Q8_1 itself
        assert torch.equal(got, want)
    codes, scales, sums = quantize(x, 16)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scales.shape == sums.shape == (3, 6)
    q = codes.float().reshape(3, 6, 16)  # [rows, blocks, 16]
    assert torch.equal(q.abs().amax(dim=-1), torch.where(scales > 0, 127.0, 0.0))  # each block uses its range
    error = (x.reshape(3, 6, 16) - scales[..., None] * q).abs()
    assert (error <= scales[..., None] / 2 * (1 + 1e-6)).all()  # rounded to the nearest code
    assert torch.allclose(sums, scales * q.sum(dim=-1))
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))  # [out, in]
    exact = x @ weight.T

    def product_error(block: int) -> float:
        return (dequantized(quantize(x, block), block) @ weight.T - exact).abs().mean().item()

    assert product_error(16) < product_error(32)


def test_exercise_3_activations_quantized_per_16(checkpoint, answers):
    grade_quantizer(answers.quantize_activations, layers(checkpoint)[2])


def test_exercise_3_grader_fails_a_quantizer_that_keeps_blocks_of_32(checkpoint):
    integer_dot = layers(checkpoint)[2]
    with pytest.raises(AssertionError):
        grade_quantizer(lambda x, block: integer_dot.quantize_q8_1(x), integer_dot)


# Exercise 5: Hugging Face's schedule for the number of drafts.


def grade_pace_by_hand(Pace) -> None:
    """k = 4: two more after a full acceptance, one fewer otherwise, within 1..k, never a wait."""
    pace = Pace(4)
    assert pace.length == 4 and pace.ready(0)
    assert pace.after(4, 4, 10, most=4).length == 4
    assert pace.after(4, 2, 10, most=4).length == 3
    missed = pace.after(4, 0, 10, most=4)
    assert missed.length == 3 and missed.ready(10)
    assert Pace(1).after(1, 1, 10, most=4).length == 3
    assert Pace(3).after(3, 3, 10, most=4).length == 4
    assert Pace(1).after(1, 0, 10, most=4).length == 1


# (drafts right in each proposal, drafts asked per verify step): k = 4, 20 tokens, the first from the prompt's
# step. Right once: 4 (1 kept, 3 tokens), 3, 2, 1 (all kept: +2), 3, 2, 1, 3, then 2 where only 2 fit before
# 20, and none at 19. Never right: 4, 3, 2, then 1 at every token to 18.
SCHEDULED = [(4, [4, 4, 4, 3]), (1, [4, 3, 2, 1, 3, 2, 1, 3, 2]), (0, [4, 3, 2] + [1] * 15)]


def grade_pace_in_the_engine(Pace, checkpoint, model_dir, monkeypatch) -> None:
    monkeypatch.setattr(submodule(checkpoint, "llm_engine"), "DraftPace", Pace)
    for right, asked in SCHEDULED:
        got, counts = scripted_run(checkpoint, model_dir, right, adaptive=True)  # asserts the plain tokens
        assert got == asked
        assert counts.num_accepted_tokens == sum(min(right, n) for n in asked)


def test_exercise_5_hugging_face_pace(checkpoint, tiny_model_dirs, monkeypatch, answers):
    grade_pace_by_hand(answers.ScheduledPace)
    grade_pace_in_the_engine(answers.ScheduledPace, checkpoint, tiny_model_dirs["gqa"], monkeypatch)


def test_exercise_5_graders_fail_the_chapters_own_pace(checkpoint, tiny_model_dirs, monkeypatch):
    Pace = submodule(checkpoint, "draft_pace").DraftPace
    with pytest.raises(AssertionError):
        grade_pace_by_hand(Pace)
    with pytest.raises(AssertionError):
        grade_pace_in_the_engine(Pace, checkpoint, tiny_model_dirs["gqa"], monkeypatch)
