"""A model's tokenizer class read from its file as data (specd/tokenizer_code.py): Kimi-K2's
class (258 special ids, tool keys sorted) and Kimi-K2.5's (256, tools in TypeScript,
`thinking` and `preserve_thinking` defaults), told apart by their own files; what each does
with names outside its block; and refusals, naming the file and line, for a file that is
missing or whose structure specd does not know."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specd.chat_preparation import SORT_TOOLS, TYPESCRIPT_TOOLS
from specd.model_fit import check_vocabulary
from specd.tiktoken_tokenizer import KIMI_PATTERN
from specd.tokenizer import Tokenizer
from specd.tokenizer_code import KIMI_CLASS, read_tokenizer_code
from tests.unit.kimi_tokenizer_files import K2_CHAT, K25_BLOCK, K25_CHAT, kimi_code, write_kimi_code
from tests.unit.test_tiktoken_tokenizer import NUM_BASE, write_model


def added(token_id: int, text: str) -> dict[str, Any]:
    return {str(token_id): {"content": text, "special": True}}


def with_names(root: Path, names: dict[str, Any]) -> Path:
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"].update(names)
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def test_each_class_is_read_from_its_own_file(tmp_path: Path) -> None:
    k2 = read_tokenizer_code(write_model(tmp_path / "k2", "k2"), KIMI_CLASS)
    assert (k2.num_special_ids, k2.pattern, k2.registers_added_tokens) == (258, KIMI_PATTERN,
                                                                          False)
    assert (k2.chat.steps, k2.chat.defaults) == ((SORT_TOOLS,), ())
    k25 = read_tokenizer_code(write_model(tmp_path / "k25", "k25"), KIMI_CLASS)
    assert (k25.num_special_ids, k25.registers_added_tokens) == (256, True)
    assert k25.chat.steps == (SORT_TOOLS, TYPESCRIPT_TOOLS)
    assert k25.chat.defaults == (("thinking", True), ("preserve_thinking", False))


def test_k25s_block_has_256_ids_and_fits_its_embedding(tmp_path: Path) -> None:
    """ranks + 256 = the embedding's rows: Kimi-K2.5 as published starts."""
    tok = Tokenizer.from_dir(write_model(tmp_path / "k25", "k25"))
    assert tok.vocab_size == NUM_BASE + 256
    assert tok.num_named_ids == NUM_BASE + 11  # the highest name; reserved ones above it
    check_vocabulary(tok.num_named_ids, NUM_BASE + 256, tmp_path)
    last = f"<|reserved_token_{NUM_BASE + 255}|>"
    assert tok.encode(last) == [NUM_BASE + 255]
    beyond = f"<|reserved_token_{NUM_BASE + 256}|>"  # text, as the class encodes it
    assert NUM_BASE + 256 not in tok.encode(beyond) and tok.decode(tok.encode(beyond)) == beyond


def test_k2s_two_unnamed_extra_ids_need_no_embedding_row(tmp_path: Path) -> None:
    """Kimi-K2's class makes 258 ids, 163,842 for 163,840 rows: the two above its last name
    are produced only from their own text, which the engine refuses per request."""
    tok = Tokenizer.from_dir(write_model(tmp_path / "k2", "k2"))
    assert tok.vocab_size == NUM_BASE + 258
    assert tok.num_named_ids == NUM_BASE + 11  # "<think>" is the highest name
    check_vocabulary(tok.num_named_ids, NUM_BASE + 256, tmp_path)
    assert tok.encode(f"<|reserved_token_{NUM_BASE + 257}|>") == [NUM_BASE + 257]
    named_high = Tokenizer.from_dir(with_names(write_model(tmp_path / "high", "k2"),
                                               added(NUM_BASE + 257, "<|late|>")))
    assert named_high.num_named_ids == NUM_BASE + 258
    with pytest.raises(ValueError, match=rf"has {NUM_BASE + 258} tokens.*{NUM_BASE + 256} rows"):
        check_vocabulary(named_high.num_named_ids, NUM_BASE + 256, tmp_path)


def test_names_outside_the_block_per_class(tmp_path: Path) -> None:
    outside = added(NUM_BASE + 300, "<|outside|>")
    # Kimi-K2's class builds its encoding from the block only: the name stays text.
    k2 = Tokenizer.from_dir(with_names(write_model(tmp_path / "k2", "k2"), outside))
    assert NUM_BASE + 300 not in k2.encode("a<|outside|>b")
    assert k2.vocab_size == NUM_BASE + 258
    # Kimi-K2.5's hands it to transformers, which would encode an id the class cannot decode.
    k25 = with_names(write_model(tmp_path / "k25", "k25"), outside)
    with pytest.raises(ValueError, match=rf"ids \[{NUM_BASE + 300}\] outside the special "
                       rf"block {NUM_BASE}..{NUM_BASE + 255} of tokenization_kimi.py"):
        Tokenizer.from_dir(k25)
    # With no tokenizer class at all, a name above the block extends it (transformers'
    # converter for a bare tiktoken.model).
    bare = write_model(tmp_path / "bare", None)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["auto_map"]
    config["added_tokens_decoder"].update(outside)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(bare).encode("<|outside|>") == [NUM_BASE + 300]


def test_a_missing_file_is_refused_by_name(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", None)
    with pytest.raises(ValueError, match=r"tokenization_kimi.py: tokenizer_config.json names "
                       r"tokenization_kimi.TikTokenTokenizer.*put the model's "
                       r"tokenization_kimi.py back"):
        Tokenizer.from_dir(root)
    write_kimi_code(root, "k25")
    (root / "tool_declaration_ts.py").unlink()
    with pytest.raises(ValueError, match=r"tokenization_kimi.py:\d+: it imports "
                       r"tool_declaration_ts.*not in the model directory"):
        Tokenizer.from_dir(root)


UNKNOWN = {
    "a block size from a call": (kimi_code(block="int(os.environ['N'])"),
                                 r"int\(os.environ\['N'\]\)\W is not a sum of integers"),
    "a block not above the ranks": (kimi_code(block="256 - num_base_tokens"),
                                    r"the special block ends at"),
    "another statement": (kimi_code(chat=K2_CHAT.replace(
        "        tools = deep_sort_dict(tools)\n",
        "        tools = deep_sort_dict(tools)\n        conversation = conversation[-8:]\n")),
        r"apply_chat_template does 'conversation = conversation\[-8:\]'"),
    "segments built in Python (Kimi-K3's kind)": (kimi_code(chat='''
    def apply_chat_template(self, conversation, tools=None, **kwargs):
        segments = build_chat_segments(conversation, tools=tools, **kwargs)
        return "".join(s.text for s in segments)
'''), r"apply_chat_template does 'segments = build_chat_segments"),
    "a keyword not handed on": (kimi_code(chat=K2_CHAT.replace(
        "add_generation_prompt=True, **kwargs", "add_generation_prompt=True, effort=1, "
        "**kwargs")), r"is not given effort=effort"),
    "a default that is no literal": (kimi_code(chat=K2_CHAT.replace(
        "add_generation_prompt=True", "add_generation_prompt=DEFAULT")),
        r"the default of add_generation_prompt is not a literal"),
    "kwargs dropped": (kimi_code(chat='''
    def apply_chat_template(self, conversation, tools=None, **kwargs):
        return super().apply_chat_template(conversation, tools=tools)
'''), r"is not given \*\*kwargs"),
    "TypeScript made but not handed on": (kimi_code(
        K25_BLOCK, K25_CHAT.replace("        if tools_ts_str is not None:\n"
                                    "            kwargs['tools_ts_str'] = tools_ts_str\n", ""),
        registers=True, typescript_import=True), r"made but never handed on"),
    "sort function not in the file": (kimi_code().replace("def deep_sort_dict", "def other"),
                                      r"deep_sort_dict is not defined in the file"),
    "a computed pattern": (kimi_code().replace(f"pat_str = {KIMI_PATTERN!r}",
                                               "pat_str = make_pattern()"),
                           r"pat_str is not a string or a join of strings"),
}


@pytest.mark.parametrize("name", sorted(UNKNOWN))
def test_structure_specd_does_not_know_is_refused_naming_file_and_line(
        tmp_path: Path, name: str) -> None:
    source, why = UNKNOWN[name]
    root = write_model(tmp_path / "m", "k25")
    (root / "tokenization_kimi.py").write_text(source)
    with pytest.raises(ValueError, match=why) as refused:
        Tokenizer.from_dir(root)
    message = str(refused.value)
    assert message.startswith(f"{root / 'tokenization_kimi.py'}:")
    assert "knows only the structure of Kimi's published tokenizer classes" in message


def test_a_class_without_apply_chat_template_hands_the_request_on(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", None)
    (root / "tokenization_kimi.py").write_text(kimi_code(chat=""))
    code = read_tokenizer_code(root, KIMI_CLASS)
    assert (code.num_special_ids, code.chat.steps, code.chat.defaults) == (258, (), ())
