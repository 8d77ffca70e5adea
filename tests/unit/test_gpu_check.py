"""tools/gpu_check.sh on the CPU: its dry run passes within the 420 s budget from its counts,
with every figure the device run owes at a step, and fails naming the step when a command's
flag, device, test file, figure, estimate or carried wheel is wrong; its set-up stops at the
first failure naming the step; the carried wheels are the fetch script's list."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
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


# The figures the device run owes (the GPU section of docs/benchmarks.md), by step.
FIGURES = {"gpu-tests": {"gpu_tests"},
           "kernels": {"bandwidth", "gemm_summary", "moe_summary"},
           "host": {"host_us_per_step", "step_us", "host_share", "speedup_bs1"},
           "daemon": {"daemon_overhead"}, "serving": {"serving_sweep"}}
PLAN_ROW = re.compile(r"^\s+(?P<name>[\w-]+)\s+(?P<cap>\d+)s\s+(?P<estimate>\d+)s\s+"
                      r"(?P<output>\S+)\s+(?P<figures>\S+)\s+(?P<status>.*)$", re.M)


def test_dry_run_passes() -> None:
    proc = _run(SCRIPT, "--dry-run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run: ok" in proc.stdout
    rows = {m["name"]: m for m in PLAN_ROW.finditer(proc.stdout)}
    assert list(rows) == list(FIGURES)  # in this order: tests first, daemon and serving last
    for name, figures in FIGURES.items():
        row = rows[name]
        assert row["status"].startswith("ok"), (name, row["status"])
        assert set(row["figures"].split(",")) == figures, name
        assert 0 < int(row["estimate"]) <= int(row["cap"]), name
    limits = re.search(r"limits: set-up (\d+) s \+ steps (\d+) s = (\d+) s \(budget (\d+) s\); "
                       r"estimated (\d+) s", proc.stdout)
    assert limits is not None
    setup, steps, total, budget, estimated = map(int, limits.groups())
    assert setup + steps == total <= budget == 420 and estimated <= total
    assert setup + sum(int(r["estimate"]) for r in rows.values()) <= 420
    # Every benchmark with a device runs on the GPU, the serving daemon included.
    assert proc.stdout.count("--device cuda)") == 3
    # The GPU section of docs/benchmarks.md names every figure and where it goes.
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    section = docs[docs.index("## GPU check"):]
    for name, figures in FIGURES.items():
        assert rows[name]["output"] in section, rows[name]["output"]
        for figure in figures:
            assert f"`{figure}`" in section, figure


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
        ("--gemm-m 1,4,16,64", "--gem-m 1,4,16,64"),                  # bench_kernels, argparse
        ("tools.bench_host --device cuda", "tools.bench_host --device cpu"),  # on the CPU
        ("tests/integration/test_float32_cuda.py", "tests/integration/test_no_such_file.py"),
    ])
    proc = _run(copy, "--dry-run", env={"WHEELS": str(_bad_wheels(tmp_path))})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert 'FAILED at step "dry-run"' in out
    problems = out[out.index("dry run: FAILED"):]
    assert re.search(r"step serving: .*No such option.*--out", problems)
    assert re.search(r"step kernels: exit 2: .*unrecognized arguments: --gem-m", problems)
    assert "step host: runs on cpu: pass --device cuda" in problems
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


def test_dry_run_fails_a_step_over_its_limit_or_with_other_figures(tmp_path: Path) -> None:
    """The estimate counts: a limit below what the step's counts cost fails it, and so do
    figures other than those its tool says it writes."""
    copy = _inject(tmp_path, [
        ("step kernels 70 bench_kernels.json", "step kernels 20 bench_kernels.json"),
        ("host_us_per_step,step_us,host_share,speedup_bs1 -",
         "host_us_per_step,step_us,speedup_bs1 -"),
        ("engine_builds=2,fixed_s=5", "engine_builds=2,fixed_s=50"),
    ])
    proc = _run(copy, "--dry-run")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    problems = out[out.index("dry run: FAILED"):]
    assert re.search(r"step kernels: estimated \d+ s \(imports .*compiles.*\), over its 20 s "
                     r"limit", problems)
    assert "step host: writes figures" in problems
    assert re.search(r"step daemon: estimated \d+ s .*over its 30 s limit", problems)


def test_a_gpu_test_over_its_limit_fails_and_the_next_runs(tmp_path: Path) -> None:
    """tests/conftest.py's device-run hooks: SPECD_TEST_TIMEOUT_S fails a test that runs past
    it (TimeoutError where it hung) and the run goes on; SPECD_TEST_REPORT gets each outcome."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")  # the hooks
    probe = tmp_path / "test_probe.py"
    probe.write_text("import time\n\ndef test_hangs():\n    time.sleep(30)\n\n"
                     "def test_after():\n    pass\n")
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), str(probe)], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
        env={**os.environ, "SPECD_TEST_TIMEOUT_S": "1", "SPECD_TEST_REPORT": str(report)})
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "TimeoutError" in proc.stdout and "1 failed, 1 passed" in proc.stdout
    data = json.loads(report.read_text())
    assert data["counts"] == {"failed": 1, "passed": 1}
    hung = next(t for t in data["tests"] if t["nodeid"].endswith("test_hangs"))
    assert "ran past SPECD_TEST_TIMEOUT_S=1 s" in hung["message"]
