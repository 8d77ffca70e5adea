"""A model whose tokenizer the grammar library cannot read serves without structured output:
status says why, one WARNING record names it, and a constrained request is refused with that
reason; the model's own requests are untouched (a mode, not a start-up failure)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from specd.ipc.structured import Regex
from specd.workers.structured.outputs import StructuredOutput
from tests.unit.test_tokenizer_misfits import ROWS, foreign_model


def test_an_unreadable_tokenizer_turns_structured_output_off_and_says_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = foreign_model(tmp_path, 1000, "</s>")  # word level, no decoder
    with caplog.at_level(logging.WARNING, logger="specd.structured"):
        structured = StructuredOutput(model, ROWS, [1], torch.device("cpu"))
    try:
        assert not structured.enabled
        assert structured.status.startswith("off: ") and "tokenizer.json" in structured.status
        (record,) = [r for r in caplog.records if getattr(r, "event", None)
                     == "structured_output_off"]
        assert record.levelno == logging.WARNING
        with pytest.raises(ValueError, match="structured output is off for this model"):
            structured.add("r1", Regex("[a-z]+"))
    finally:
        structured.close()
