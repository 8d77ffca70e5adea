"""A model that ships `tiktoken.model` (Kimi-K2's kind) and no tokenizer.json: the same ids as
tiktoken itself, Kimi's special-token block, BOS/EOS, its chat template, and streaming
detokenization of characters split across byte-level tokens. A model with no tokenizer
file at all fails at start-up naming both."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from specd.daemon.config import DaemonConfig
from specd.daemon.detokenizer import IncrementalDetokenizer
from specd.daemon.main import run_daemon
from specd.exit_codes import EXIT_CONFIG
from specd.tiktoken_tokenizer import KIMI_PATTERN, MAX_ENCODE_CHARS, MAX_RUN_CHARS, _pieces
from specd.tokenizer import Tokenizer
from specd.workers.config import EngineConfig
from tests.unit.kimi_tokenizer_files import write_kimi_code

# Kimi's pat_str (tokenization_kimi.py), written out again as the oracle's.
PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# A small BPE: the 256 bytes, then merges in rank order. "你好" is e4 bd a0 | e5 a5 bd: the
# last four merges make every token of "你好你好..." end inside a character
# ([e4 bd] [a0 e5 a5] [bd e4 bd] [a0 e5 a5] ... [bd]); "🙂" (f0 9f 99 82) is two tokens.
MERGES = [b"he", b"ll", b"llo", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"'s",
          b"\xf0\x9f", b"\x99\x82", b"\xe4\xbd", b"\xe5\xa5", b"\xa0\xe5\xa5", b"\xbd\xe4\xbd"]
NUM_BASE = 256 + len(MERGES)
BOS, EOS, IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, THINK = (
    NUM_BASE, NUM_BASE + 1, NUM_BASE + 2, NUM_BASE + 3, NUM_BASE + 4, NUM_BASE + 6,
    NUM_BASE + 7, NUM_BASE + 10)
ADDED = {BOS: "[BOS]", EOS: "[EOS]", IM_END: "<|im_end|>", IM_USER: "<|im_user|>",
         IM_ASSISTANT: "<|im_assistant|>", IM_SYSTEM: "<|im_system|>",
         IM_MIDDLE: "<|im_middle|>", THINK: "<think>"}
TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
TEXTS = ["hello world", "Hello World's hello", "你好你好你好 world", "🙂🙂 ok", "a  \n\n b\t",
         "中文English混合 123456", "x" * 100, ""]


def write_model(root: Path, code: str | None = "k2", **config: Any) -> Path:
    """A Kimi-like model directory; `code`: which class's tokenization_kimi.py (none: None)."""
    root.mkdir(parents=True, exist_ok=True)
    if code is not None:
        write_kimi_code(root, code)
    ranks = [bytes([b]) for b in range(256)] + MERGES
    (root / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(ranks)))
    added = {str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": text != "<think>"}
             for i, text in ADDED.items()}
    config = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]",
              "tokenizer_class": "TikTokenTokenizer", "chat_template": TEMPLATE,
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
              **config}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("kimi-like"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def oracle(model_dir: Path) -> tiktoken.Encoding:
    """The same file through tiktoken directly, with Kimi's special block (ids NUM_BASE to
    NUM_BASE + 257, unnamed ones reserved)."""
    specials = {ADDED.get(i, f"<|reserved_token_{i}|>"): i
                for i in range(NUM_BASE, NUM_BASE + 256 + 2)}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TIKTOKEN_CACHE_DIR", "")  # read the file, copy it nowhere
        ranks = load_tiktoken_bpe(str(model_dir / "tiktoken.model"))
    return tiktoken.Encoding("oracle", pat_str=PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials)


def test_the_pattern_is_kimis() -> None:
    assert KIMI_PATTERN == PATTERN


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_tiktoken_loaded_directly_and_round_trip(
        tokenizer: Tokenizer, oracle: tiktoken.Encoding, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == oracle.encode(text, allowed_special="all")
    assert tokenizer.decode(ids) == text


def test_special_tokens_encode_from_text_and_decode_by_their_flag(
        tokenizer: Tokenizer, oracle: tiktoken.Encoding) -> None:
    text = "[BOS]hello<|im_end|><think>hello<|reserved_token_300|>"
    ids = tokenizer.encode(text)
    assert ids == oracle.encode(text, allowed_special="all")
    hello = oracle.encode("hello")
    assert ids == [BOS, *hello, IM_END, THINK, *hello, 300]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == "hello<think>hello"  # "<think>" is not special
    assert tokenizer.vocab_size == NUM_BASE + 258 == oracle.n_vocab
    assert tokenizer.decode([tokenizer.vocab_size, 10**6]) == ""  # ids with no token


def test_bos_and_eos(tmp_path: Path, tokenizer: Tokenizer) -> None:
    # Kimi sets no add_bos_token: prompts get no BOS; EOS from the tokenizer's eos_token.
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("[BOS]", "[EOS]")
    assert tokenizer.prefix_ids == () and tokenizer.suffix_ids == ()
    assert tokenizer.eos_token_ids == (EOS,)
    with_bos = write_model(tmp_path / "bos", add_bos_token=True)
    (with_bos / "generation_config.json").write_text(json.dumps({"eos_token_id": IM_END}))
    tok = Tokenizer.from_dir(with_bos)
    assert tok.eos_token_ids == (IM_END,)
    assert tok.encode("hello")[0] == BOS and tok.encode("[BOS]hello")[:2] != [BOS, BOS]
    assert tok.encode("hello", add_special_tokens=False)[0] != BOS


def test_chat_template_renders_and_encodes_its_special_tokens(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "你好"}, {"role": "user", "content": "hello"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == ("<|im_system|>system<|im_middle|>你好<|im_end|>"
                    "<|im_user|>user<|im_middle|>hello<|im_end|>"
                    "<|im_assistant|>assistant<|im_middle|>")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert [i for i in ids if i >= NUM_BASE] == [
        IM_SYSTEM, IM_MIDDLE, IM_END, IM_USER, IM_MIDDLE, IM_END, IM_ASSISTANT, IM_MIDDLE]


def test_chat_template_jinja_file_wins_over_the_config_field(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m")
    (root / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = Tokenizer.from_dir(root)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_streaming_never_splits_a_character_across_byte_level_tokens(
        tokenizer: Tokenizer, chunk: int) -> None:
    text = "你好" * 12 + "🙂 hello"
    ids = tokenizer.encode(text)
    # The test means something: the first 24 tokens all end inside a character, more than
    # a detokenizer that waits only a few tokens for a character to complete can hold.
    assert all(tokenizer.decode(ids[:n]).endswith("\ufffd") for n in range(1, 24))
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.finish())
    assert "".join(pieces) == text == detok.text
    assert not any("\ufffd" in piece for piece in pieces)
    assert sum(1 for piece in pieces if piece) > len(pieces) // 2  # text flows as it comes


def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement(
        tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🙂")[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids) == "ok "
    assert detok.finish() == "\ufffd"


def kimi_split(s: str, max_len: int) -> list[str]:
    """tokenization_kimi.py's _split_whitespaces_or_nonwhitespaces, as the reference."""
    out, length, is_space, start = [], 0, s[0].isspace() if s else False, 0
    for i, char in enumerate(s):
        if is_space ^ char.isspace():
            length, is_space = 1, char.isspace()
        else:
            length += 1
            if length > max_len:
                out.append(s[start:i])
                start, length = i, 1
    out.append(s[start:])
    return out


@pytest.mark.parametrize("text", [
    "short text", "a" * (MAX_RUN_CHARS * 2 + 7) + " b",
    " " * (MAX_RUN_CHARS + 1) + "x" * MAX_RUN_CHARS + "\n" * (MAX_RUN_CHARS * 3),
    ("word " * 100_000)[:MAX_ENCODE_CHARS + 10] + "y" * 30_000])
def test_long_runs_are_cut_where_kimi_cuts_them(text: str) -> None:
    chunks = [text[i:i + MAX_ENCODE_CHARS] for i in range(0, len(text), MAX_ENCODE_CHARS)]
    assert list(_pieces(text)) == [p for c in chunks for p in kimi_split(c, MAX_RUN_CHARS)]


def test_byte_bound_counts_the_longest_token_and_special_name(tokenizer: Tokenizer) -> None:
    assert tokenizer.max_bytes_per_token == len("<|reserved_token_300|>")


def test_pattern_from_config_and_unknown_tokenizer_code(
        tmp_path: Path, tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("hello world") == [259, 264]  # Kimi's: " world" is one piece
    plain = Tokenizer.from_dir(write_model(tmp_path / "plain", pat_str=r"\S+|\s+"))
    assert plain.encode("hello world") == [259, 32, 119, 261, 263]
    assert plain.max_bytes_per_token is None  # a pattern that might skip text: no bound
    unknown = write_model(tmp_path / "unknown",
                          auto_map={"AutoTokenizer": ["org/repo--tok.Other", None]})
    with pytest.raises(ValueError, match="tok.Other.*pat_str"):
        Tokenizer.from_dir(unknown)


def test_a_malformed_tiktoken_file_is_named(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m")
    with (root / "tiktoken.model").open("a") as f:
        f.write("not-base64!! 999\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:273: expected"):
        Tokenizer.from_dir(root)


def test_a_model_with_no_tokenizer_file_exits_78_naming_both(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        code = run_daemon(DaemonConfig(engine=EngineConfig(model=str(tmp_path))))
    assert code == EXIT_CONFIG
    (record,) = [r for r in caplog.records if getattr(r, "event", None) == "config_error"]
    message = record.getMessage()
    assert "tokenizer.json" in message and "tiktoken.model" in message and "\n" not in message
