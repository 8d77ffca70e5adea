"""install-service: the units and env file it writes for a model, user and executable."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import specd.systemd
from specd.daemon.ctl.service_install import default_template_dir, install_service

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "srv" / "model"
    draft = tmp_path / "srv" / "draft"
    model.mkdir(parents=True)
    draft.mkdir()
    specd_bin = tmp_path / "venv" / "bin" / "specd"
    specd_bin.parent.mkdir(parents=True)
    specd_bin.write_text("#!/bin/sh\n")
    return {"model": model, "draft": draft, "bin": specd_bin, "root": tmp_path / "root"}


def run(paths: dict[str, Path], *extra: str) -> Result:
    args = ["--model", str(paths["model"]), "--specd-bin", str(paths["bin"]),
            "--prefix", str(paths["root"]), *extra]
    return CliRunner().invoke(install_service, args)


def read(paths: dict[str, Path], real_path: str) -> str:
    return (paths["root"] / real_path.lstrip("/")).read_text()


def test_writes_units_and_env_for_the_model(paths: dict[str, Path]) -> None:
    result = run(paths, "--draft", str(paths["draft"]), "--user", "root",
                 "--extra-args", "--max-num-seqs 8")
    assert result.exit_code == 0, result.output
    service = read(paths, "/etc/systemd/system/specd.service")
    assert f"ExecStart={paths['bin']} --model ${{SPECD_MODEL}}" in service
    assert "\nEnvironmentFile=/etc/specd/specd.env\n" in service
    assert "\nUser=root\n" in service and "\nGroup=root\n" in service
    assert "\nType=notify\n" in service and "\nRestartPreventExitStatus=78\n" in service
    socket_unit = read(paths, "/etc/systemd/system/specd.socket")
    assert "\nSocketUser=root\n" in socket_unit and "\nSocketGroup=root\n" in socket_unit
    env = read(paths, "/etc/specd/specd.env")
    assert f"\nSPECD_MODEL={paths['model']}\n" in env
    assert (f"\nSPECD_ARGS=--device cuda --log-format json --draft-model {paths['draft']} "
            "--max-num-seqs 8\n") in env
    # root exists, so no sysusers.d entry; the paths are not under /home, so no drop-in.
    assert not (paths["root"] / "etc" / "sysusers.d").exists()
    assert not (paths["root"] / "etc/systemd/system/specd.service.d").exists()
    assert "systemctl daemon-reload" in result.output
    assert "systemctl enable --now specd.socket specd.service" in result.output


def test_missing_user_gets_a_sysusers_entry(paths: dict[str, Path]) -> None:
    result = run(paths, "--user", "specd-test-nobody")
    assert result.exit_code == 0, result.output
    sysusers = read(paths, "/etc/sysusers.d/specd-test-nobody.conf")
    assert 'u specd-test-nobody - "specd inference daemon" /var/lib/specd' in sysusers
    assert "systemd-sysusers /etc/sysusers.d/specd-test-nobody.conf" in result.output


def test_dry_run_prints_and_writes_nothing(paths: dict[str, Path]) -> None:
    result = run(paths, "--user", "root", "--dry-run")
    assert result.exit_code == 0, result.output
    assert not paths["root"].exists()
    assert "would write" in result.output and "[Service]" in result.output
    assert f"SPECD_MODEL={paths['model']}" in result.output


def test_existing_different_file_needs_force(paths: dict[str, Path]) -> None:
    assert run(paths, "--user", "root").exit_code == 0
    env_file = paths["root"] / "etc/specd/specd.env"
    env_file.write_text("SPECD_MODEL=/edited/by/operator\n")
    refused = run(paths, "--user", "root")
    assert refused.exit_code != 0
    assert "exists with other contents; use --force" in refused.output
    assert env_file.read_text() == "SPECD_MODEL=/edited/by/operator\n"
    assert run(paths, "--user", "root", "--force").exit_code == 0
    assert f"SPECD_MODEL={paths['model']}" in env_file.read_text()


def test_rerun_with_same_contents_is_idempotent(paths: dict[str, Path]) -> None:
    assert run(paths, "--user", "root").exit_code == 0
    assert run(paths, "--user", "root").exit_code == 0


def test_whitespace_in_args_is_refused(paths: dict[str, Path]) -> None:
    spaced = paths["model"].parent / "my model"
    spaced.mkdir()
    result = CliRunner().invoke(install_service, ["--model", str(spaced), "--specd-bin",
                                                  str(paths["bin"]), "--dry-run"])
    assert result.exit_code != 0
    assert "may not contain whitespace" in result.output


def test_missing_model_directory_is_refused(paths: dict[str, Path]) -> None:
    result = CliRunner().invoke(install_service, ["--model", "/nonexistent/model", "--dry-run"])
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_paths_under_home_get_protect_home_read_only(paths: dict[str, Path]) -> None:
    result = run(paths, "--user", "root", "--specd-bin", "/root/.venv/bin/specd")
    assert result.exit_code == 0, result.output
    dropin = read(paths, "/etc/systemd/system/specd.service.d/10-protect-home.conf")
    assert "#   /root/.venv/bin/specd\n" in dropin
    assert dropin.endswith("[Service]\nProtectHome=read-only\n")


def test_templates_come_from_the_installed_package() -> None:
    # importlib.resources finds them wherever specd is installed (a wheel, or editable).
    templates = default_template_dir()
    assert templates == Path(specd.systemd.__file__).parent
    for name in ("specd.service", "specd.socket", "specd.env"):
        assert (templates / name).is_file(), name


def test_every_template_ships_in_the_wheel() -> None:
    # pyproject maps specd.systemd to systemd/ and lists its package data: a template
    # that no pattern matches would be missing from an installed wheel.
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"]["specd.systemd"] == "systemd"
    assert "specd.systemd" in setuptools["packages"]
    patterns = setuptools["package-data"]["specd.systemd"]
    templates = [p.name for p in (REPO / "systemd").iterdir() if p.suffix != ".py"
                 and p.name != "__pycache__"]
    assert sorted(templates) == ["specd-http.conf", "specd-nodes.conf", "specd-worker.env",
                                 "specd-worker.service", "specd.env", "specd.service",
                                 "specd.socket"]
    for name in templates:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name
