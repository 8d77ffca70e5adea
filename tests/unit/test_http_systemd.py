"""The HTTP drop-in (systemd/specd-http.conf): with it the units still pass systemd's own
checks and the sandbox opens only to TCP; without it the unit keeps no network at all."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from specd.daemon.ctl.service_install import install_service

DROP_IN = Path(__file__).resolve().parents[2] / "systemd" / "specd-http.conf"
# Measured 1.4 with systemd 252 (0.7 without the drop-in): the network points come back.
MAX_EXPOSURE_WITH_HTTP = 1.5

pytestmark = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (Debian package: systemd)",
)


@pytest.fixture(scope="module")
def unit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The units as install-service renders them, with the drop-in installed beside."""
    tmp = tmp_path_factory.mktemp("units")
    (tmp / "model").mkdir()
    specd_bin = tmp / "bin" / "specd"
    specd_bin.parent.mkdir()
    specd_bin.write_text("#!/bin/sh\nexit 0\n")
    specd_bin.chmod(0o755)
    result = CliRunner().invoke(install_service, [
        "--model", str(tmp / "model"), "--specd-bin", str(specd_bin), "--prefix",
        str(tmp / "root"), "--user", "specd"])
    assert result.exit_code == 0, result.output
    units = tmp / "root" / "etc" / "systemd" / "system"
    (units / "specd.service.d").mkdir()
    shutil.copy(DROP_IN, units / "specd.service.d" / "http.conf")
    return units


def analyze(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", *map(str, args)], capture_output=True, text=True,
                          timeout=60)


def test_the_drop_in_verifies_clean(unit_dir: Path) -> None:
    result = analyze("verify", "--man=no", unit_dir / "specd.service", unit_dir / "specd.socket")
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_verify_reads_the_drop_in(unit_dir: Path, tmp_path: Path) -> None:
    # The check above covers the drop-in: a typo in it is reported.
    units = tmp_path / "units"
    shutil.copytree(unit_dir, units)
    conf = units / "specd.service.d" / "http.conf"
    conf.write_text(conf.read_text().replace("AF_INET6", "AF_INETX"))
    result = analyze("verify", "--man=no", units / "specd.service", units / "specd.socket")
    assert "AF_INETX" in result.stderr


def test_the_sandbox_opens_only_for_tcp(unit_dir: Path) -> None:
    result = analyze("security", "--offline=yes", unit_dir / "specd.service")
    match = re.search(r"Overall exposure level for specd\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE_WITH_HTTP, result.stdout
    drop_in = DROP_IN.read_text()
    assert "\nIPAddressAllow=localhost\n" in drop_in and "\nIPAddressDeny=" not in drop_in
    assert re.findall(r"^RestrictAddressFamilies=(.*)$", drop_in, re.MULTILINE) == [
        "", "AF_UNIX AF_INET AF_INET6"]


def test_without_the_drop_in_the_unit_has_no_network() -> None:
    service = (DROP_IN.parent / "specd.service").read_text()
    assert "\nPrivateNetwork=yes\n" in service and "\nIPAddressDeny=any\n" in service
    assert "\nRestrictAddressFamilies=AF_UNIX\n" in service
