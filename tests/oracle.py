"""Hugging Face transformers as the oracle: greedy generation and logits to compare against."""

import weakref

import torch

# Every checkpoint is compared with the same references: compute each once, per model object. Keyed by the
# model itself, weakly (not by its id: a short-lived model's id is reused by the next one, which would then
# read the first one's answers).
_greedy_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate(do_sample=False)` for one prompt: the generated ids (stops at EOS)."""
    answers, key = _greedy_cache.setdefault(hf_model, {}), (tuple(prompt_ids), max_new_tokens)
    if key not in answers:
        answers[key] = _hf_greedy(hf_model, list(prompt_ids), max_new_tokens)
    return list(answers[key])


@torch.inference_mode()
def _hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    out = hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=hf_model.config.eos_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[seq, vocab] logits of one sequence."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()
