"""Prompt special tokens follow the tokenizer's own rule, as transformers' AutoTokenizer does:
a Llama-3-style tokenizer.json adds its BOS through the post-processor; a chat template's
output, which writes its own BOS, never gets a second one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR

BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
CORPUS = ["def add(a, b):\n    return a + b\n", "Hello world, hello tokenizer!",
          "The quick brown fox jumps over the lazy dog.", "naïve café 日本語"] * 20
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
TEXTS = ["def add(a, b):", "Hello world", " leading space", "日本語 café", "", f"{BOS}Hello"]


def write_tokenizer(root: Path, post_processor: bool, **config: Any) -> Path:
    """A small byte-level BPE in Llama-3's shape: ByteLevel pre-tokenizer and decoder, and
    (with `post_processor`) a ByteLevel + TemplateProcessing post-processor adding BOS."""
    root.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", EOT]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if post_processor:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS}:0 $A:0",
                                          pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                                          special_tokens=[(BOS, bos_id)])])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOT,
        "chat_template": TEMPLATE, **config}))
    return root


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("llama3"), post_processor=True)


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_ids_equal_autotokenizers(llama3_dir: Path, text: str) -> None:
    ours = Tokenizer.from_dir(llama3_dir)
    theirs = AutoTokenizer.from_pretrained(str(llama3_dir))(text)["input_ids"]
    bos = ours.encode("", add_special_tokens=True)
    assert ours.prefix_ids == tuple(bos) and len(bos) == 1
    if text.startswith(BOS):
        # transformers adds a second BOS in front of the one the text holds; specd does not.
        assert theirs[:2] == bos * 2 and ours.encode(text) == theirs[1:]
    else:
        assert ours.encode(text) == theirs
        assert ours.encode(text, add_special_tokens=False) == theirs[1:]


def test_a_chat_template_that_writes_bos_gets_no_second_one(llama3_dir: Path) -> None:
    ours = Tokenizer.from_dir(llama3_dir)
    theirs = AutoTokenizer.from_pretrained(str(llama3_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = ours.apply_chat_template(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=True)
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True,
                                          return_dict=False)
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == expected and ids.count(ours.prefix_ids[0]) == 1
    assert ours.encode(text) == ids  # the prompt rule adds no BOS before its own either


def test_no_post_processor_follows_the_add_bos_token_flag(tmp_path: Path) -> None:
    without = Tokenizer.from_dir(write_tokenizer(tmp_path / "a", post_processor=False))
    assert without.prefix_ids == () and without.suffix_ids == ()
    flagged = Tokenizer.from_dir(write_tokenizer(tmp_path / "b", post_processor=False,
                                                 add_bos_token=True))
    (bos,) = flagged.prefix_ids
    assert flagged.encode("Hello")[0] == bos and flagged.encode(f"{BOS}Hello").count(bos) == 1


def test_the_fixture_models_prompts_are_unchanged() -> None:
    ours = Tokenizer.from_dir(FIXTURE_DIR)
    theirs = AutoTokenizer.from_pretrained(str(FIXTURE_DIR))
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.prefix_ids == () and ours.suffix_ids == ()
