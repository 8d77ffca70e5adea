"""tools/gpu_check.sh on the CPU: its dry run passes, and fails naming the step when a
command's flag, device, test file or carried wheel is wrong; its set-up stops at the first
failure naming the step; the carried wheels are the fetch script's list."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
FETCH = ROOT / "tools" / "fetch_gpu_wheels.sh"
WHEELS = ROOT / "tools" / "gpu_wheels"

pytestmark = pytest.mark.slow


def _run(script: Path, *args: str, env: dict[str, str] | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout,
                          env={**os.environ, "SPECD_ROOT": str(ROOT), **(env or {})})


def _inject(tmp_path: Path, replacements: list[tuple[str, str]]) -> Path:
    """A copy of gpu_check.sh with each (old, new) replaced once (each must be present)."""
    text = SCRIPT.read_text()
    for old, new in replacements:
        assert old in text, f"gpu_check.sh no longer contains {old!r}"
        text = text.replace(old, new, 1)
    copy = tmp_path / "gpu_check.sh"
    copy.write_text(text)
    return copy


def test_scripts_parse() -> None:
    for script in (SCRIPT, FETCH):
        subprocess.run(["bash", "-n", str(script)], check=True)
        if shutil.which("shellcheck"):
            subprocess.run(["shellcheck", str(script)], check=True)


def test_dry_run_passes() -> None:
    proc = _run(SCRIPT, "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run: ok" in proc.stdout
    for name in ("gpu-tests", "kernels", "overlap", "spec", "shapes", "engine", "daemon",
                 "serving"):
        assert re.search(rf"^\s+{name}\s+\d+s\s+\S+\s+ok", proc.stdout, re.M), name
    # Every benchmark with a device runs on the GPU, the serving daemon included.
    assert proc.stdout.count("--device cuda)") == 6


def _bad_wheels(tmp_path: Path) -> Path:
    """The carried wheels less loguru, plus a CPython 3.11 wheel nobody listed."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    for wheel in WHEELS.glob("*.whl"):
        if not wheel.name.startswith("loguru-"):
            shutil.copy(wheel, folder)
    with zipfile.ZipFile(folder / "stray-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", "w") as z:
        z.writestr("stray-1.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: stray\nVersion: 1.0\n")
    return folder


def test_dry_run_fails_on_a_wrong_flag_device_test_file_or_wheel(tmp_path: Path) -> None:
    """One copy of the script with several faults: each is reported, by step, and the dry
    run exits 1. The serving fault is a flag the serving benchmark does not have (`--out`
    where it takes `--out-dir`)."""
    copy = _inject(tmp_path, [
        ('--no-plots --out-dir "$SCRATCH/serving"', '--no-plots --out "$SCRATCH/serving"'),
        ("--concurrency 1 16 64", "--concurency 1 16 64"),           # bench_spec, argparse
        ("--device cuda --rounds 1", "--device cpu --rounds 1"),      # bench_engine on the CPU
        ("tests/integration/test_overlap.py", "tests/integration/test_no_such_file.py"),
    ])
    proc = _run(copy, "--dry-run", env={"WHEELS": str(_bad_wheels(tmp_path))})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert 'FAILED at step "dry-run"' in out
    problems = out[out.index("dry run: FAILED"):]
    assert re.search(r"step serving: .*No such option.*--out", problems)
    assert re.search(r"step spec: exit 2: .*unrecognized arguments: --concurency", problems)
    assert "step engine: runs on cpu: pass --device cuda" in problems
    assert "step gpu-tests: test file tests/integration/test_no_such_file.py does not exist" \
        in problems
    assert "loguru==0.7.3 is listed but its wheel is not in" in problems
    assert "stray-1.0-cp311-cp311-manylinux_2_17_x86_64.whl is not in" in problems
    assert "stray-1.0-cp311-cp311-manylinux_2_17_x86_64.whl does not install on CPython 3.12" \
        in problems
    # A flag the private daemon (`specd`) does not have fails the serving step too: its
    # own parser reads --daemon-args. (A step reports its first fault only: a copy of its own.)
    copy = _inject(tmp_path, [('--daemon-args "--device cuda"',
                               '--daemon-args "--device cuda --no-such-flag"')])
    proc = _run(copy, "--dry-run")
    assert proc.returncode == 1
    assert re.search(r"step serving: .*--no-such-flag", proc.stdout)


def test_set_up_stops_at_the_first_failure_naming_the_step(tmp_path: Path) -> None:
    empty = tmp_path / "none"
    empty.mkdir()
    proc = _run(SCRIPT, env={"WHEELS": str(empty), "OUT": str(tmp_path / "out0")})
    assert proc.returncode == 1
    assert 'FAILED at step "wheels": no wheels in' in proc.stderr
    # The pure-Python wheels install on this Python too: install, link farm and imports
    # pass, and the CPU machine stops it at the device step, before any measurement.
    pure = tmp_path / "pure"
    pure.mkdir()
    for wheel in WHEELS.glob("*-none-any.whl"):
        shutil.copy(wheel, pure)
    out = tmp_path / "out1"
    proc = _run(SCRIPT, env={"WHEELS": str(pure), "OUT": str(out)})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert 'FAILED at step "device"' in proc.stderr
    log = (out / "gpu_check.log").read_text()
    assert "specd.kernels.int4_gemm" in log and "no CUDA device" in log
    assert "gpu-tests" not in log


def _pinned() -> dict[str, str]:
    lines = subprocess.run(["bash", str(FETCH), "--list"], capture_output=True, text=True,
                           check=True).stdout.split()
    return {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in (x.split("==") for x in lines)}


def test_carried_wheels_are_the_fetch_list_for_cp312() -> None:
    pinned = _pinned()
    wheels = {}
    for wheel in WHEELS.glob("*.whl"):
        name, version, *_, py, abi, plat = wheel.name[:-4].split("-")
        wheels[re.sub(r"[-_.]+", "-", name).lower()] = version
        assert py in ("py3", "cp312") or (py == "cp312" and abi == "abi3"), wheel.name
        assert plat == "any" or "manylinux" in plat and plat.endswith("x86_64"), wheel.name
    assert wheels == pinned
    assert sum(w.stat().st_size for w in WHEELS.glob("*.whl")) < 10 * 2**20  # committed


def test_fetch_list_covers_what_the_gpu_image_lacks() -> None:
    """pyzmq, msgspec and compressed-tensors (not on the GPU image) are carried, at versions
    pyproject.toml accepts."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]
                    + project["optional-dependencies"]["test"]]
    pinned = _pinned()
    for req in requirements:
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in ("pyzmq", "msgspec", "compressed-tensors", "hypothesis"):
            assert name in pinned, name
            assert req.specifier.contains(pinned[name]), (name, pinned[name], req)
