"""A tokenizer that fits the embedding but belongs to another model is named with the
evidence: far fewer tokens than rows (1,000 on the fixture's 4,096), special tokens whose
ids the model's config does not declare. The fixture's own tokenizer is not, nor a
tokenizer of a few padding rows less."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from specd.model_fit import declared_special_ids, tokenizer_misfits
from specd.tokenizer import Tokenizer
from specd.workers.config import FIXTURE_DIR

ROWS = json.loads((FIXTURE_DIR / "config.json").read_text())["vocab_size"]


def foreign_model(tmp_path: Path, num_tokens: int, eos_token: str) -> Path:
    """The fixture's model files with a word-level tokenizer of `num_tokens` tokens ("<s>"
    id 0, "</s>" id 1) and `eos_token` as tokenizer_config.json's eos_token."""
    model = tmp_path / "model"
    model.mkdir()
    for path in FIXTURE_DIR.iterdir():
        if path.is_file() and path.name not in ("tokenizer.json", "tokenizer_config.json"):
            (model / path.name).symlink_to(path)
    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, num_tokens)}}
    tokenizer = HFTokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}))
    return model


def _misfits(model: Path) -> list[str]:
    return tokenizer_misfits(Tokenizer.from_dir(model), ROWS, declared_special_ids(model))


def test_the_fixtures_own_tokenizer_fits() -> None:
    assert _misfits(FIXTURE_DIR) == []


def test_a_much_smaller_tokenizer_is_named_with_both_sizes(tmp_path: Path) -> None:
    (evidence,) = _misfits(foreign_model(tmp_path, 1000, eos_token="<s>"))
    assert evidence == (f"the tokenizer has 1000 tokens for the model's {ROWS} embedding rows "
                        "(config.json vocab_size): 76% of the rows no text reaches")


def test_a_few_padding_rows_are_no_misfit(tmp_path: Path) -> None:
    assert _misfits(foreign_model(tmp_path, ROWS - 64, eos_token="<s>")) == []


def test_special_tokens_the_config_gives_other_ids_are_named(tmp_path: Path) -> None:
    model = foreign_model(tmp_path, ROWS, eos_token="</s>")  # id 1; the config says 0
    (evidence,) = _misfits(model)
    assert evidence == ("tokenizer_config.json's eos_token '</s>' is id 1 in the tokenizer, "
                        "but the model's config gives eos_token_id [0]")
    shutil.copy(FIXTURE_DIR / "tokenizer_config.json", model / "tokenizer_config.json")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|not_a_token|>"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert any("bos_token '<|not_a_token|>' is no token of the tokenizer" in x
               for x in _misfits(model))
