#!/usr/bin/env bash
# The one device check of specd on a bare GPU machine (an H200: Python 3.12, torch, triton,
# transformers; no network), in under 8 minutes. Run from anywhere:
#
#   OUT=/some/dir bash tools/gpu_check.sh [--quick] [--fail-fast]
#   bash tools/gpu_check.sh --dry-run      # any machine, no GPU (CI runs it): checks the plan
#
# Set-up, each step fatal (set -euo pipefail; the first failure stops the script and names
# its step):
#   wheels   installs the carried cp312 wheels (tools/gpu_wheels, or $WHEELS; fetched by
#            tools/fetch_gpu_wheels.sh) with pip --no-index into a private folder
#            (WHEELS=none skips this on a machine that has specd's dependencies)
#   specd    makes specd importable without pip: a link farm built from pyproject.toml's
#            package-dir, with the checkout's tools/ beside it (the tools run as
#            `python -m tools.NAME`), first on PYTHONPATH, with PYTHONSAFEPATH=1 so that the
#            checkout's own specd/ folder (the root package alone) never shadows it
#   imports  imports every module specd, its tools and the GPU tests need, printing versions
#   device   nvidia-smi, torch and triton versions; a CUDA device is required
# Measurements, most valuable first, each under its own time limit (`timeout`), each writing
# its JSON into $OUT as it goes (the tools rewrite their JSON after every part, so a step cut
# short keeps what it measured):
#   gpu-tests  pytest -m gpu on the GPU test files          (log only)
#   kernels    tools/bench_kernels.py: copy bandwidth, INT4 GEMM (g32, g128) and attention
#              kernels as shares of it, the host's share of a batch-1 step
#   overlap    tools/bench_overlap.py: overlap scheduling x CUDA graphs
#   spec       tools/bench_spec.py: acceptance, batch-1 speedup, throughput by mode
#   shapes     tools/bench_shapes.py: Llama-3.1-8B INT4 + EAGLE-3 shapes, where speculation
#              stops paying by batch size
#   engine     tools/bench_engine.py: in-process engine vs transformers
#   daemon     tools/bench_daemon.py: daemon overhead
#   serving    tools/bench_serving.py: the serving sweep (JSON copied into $OUT)
# A failed or timed-out measurement is reported at once by name and the next one runs (the
# machine is lent for minutes: one broken benchmark must not cost the others' figures); the
# script then exits 1 naming them. --fail-fast stops at the first one instead.
#
# $OUT (default bench_out/gpu_check) receives at most 8 files: gpu_check.log and one JSON
# per measurement. The step limits and the set-up's add up to at most $BUDGET_S seconds.
#
# --dry-run runs no measurement: it checks that the carried wheels are exactly
# fetch_gpu_wheels.sh's list, for CPython 3.12 on manylinux x86_64, with every requirement met
# by the folder or the GPU image; that the link farm imports specd; that every command of
# the plan parses its flags (each tool's own argparse or click parser, the private daemon's
# `specd` flags included), passes --device cuda where the tool has a device, and writes under
# $OUT; that every test file it names exists and holds GPU tests; and that the files and the
# time limits fit. Any problem fails it (exit 1).
set -Eeuo pipefail

usage() { sed -n '2,44p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

DRY_RUN=0
QUICK=0
FAIL_FAST=0
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --quick) QUICK=1 ;;
        --fail-fast) FAIL_FAST=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

ROOT=${SPECD_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
cd "$ROOT"
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-tools/gpu_wheels}
BUDGET_S=470           # every limit below added up: under the 8-minute target
SETUP_CAPS_S=60        # wheels 15 + imports 30 + device 15
MAX_OUT_FILES=8        # what a device run brings back
WORK=$(mktemp -d "${TMPDIR:-/tmp}/specd_gpu_check.XXXXXX")
SITE=$WORK/site        # the carried wheels, installed
SRC=$WORK/src          # the specd link farm
SCRATCH=$WORK/scratch  # tool outputs that are not copied into $OUT whole
PLAN=$WORK/plan        # the dry run's record of each planned command
if [ "$DRY_RUN" = 1 ]; then
    OUT=$WORK/out
else
    OUT=${OUT:-bench_out/gpu_check}
fi
mkdir -p "$OUT" "$SITE" "$SRC" "$SCRATCH" "$PLAN"
OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu_check.log
: >"$LOG"
START=$(date +%s)
STEP=start
FAILED=()
SKIPPED=()
STEP_COUNT=0
trap 'rm -rf "$WORK"' EXIT
trap 'echo "gpu_check: FAILED at step \"$STEP\" (exit $?, line $LINENO); log: $LOG" | tee -a "$LOG" >&2' ERR

export PYTHONUNBUFFERED=1
export TRITON_INTERPRET=0  # tests/conftest.py turns the interpreter on unless told otherwise
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

say() { printf '== %s (%ss)\n' "$*" "$(($(date +%s) - START))" | tee -a "$LOG"; }
die() { echo "gpu_check: FAILED at step \"$STEP\": $*" | tee -a "$LOG" >&2; trap - ERR; exit 1; }
elapsed() { echo $(($(date +%s) - START)); }

# ----------------------------------------------------------------------------- the plan
# step NAME LIMIT_S OUTPUT -- COMMAND...: one measurement. OUTPUT is the file it leaves in
# $OUT ("-": none). The dry run records the command instead of running it.
step() {
    local name=$1 cap=$2 output=$3
    shift 4
    STEP_COUNT=$((STEP_COUNT + 1))
    if [ "$DRY_RUN" = 1 ]; then
        printf '%s\0' "$name" "$cap" "$output" "$@" >"$PLAN/$(printf '%02d' "$STEP_COUNT")"
        return 0
    fi
    STEP=$name
    local left limit rc=0
    left=$((BUDGET_S - $(elapsed)))
    if [ "$left" -lt 15 ]; then
        say "skip $name: ${left}s of the ${BUDGET_S}s budget left"
        SKIPPED+=("$name")
        return 0
    fi
    limit=$((cap < left ? cap : left))
    say "$name (limit ${limit}s)"
    echo "\$ $*" >>"$LOG"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG" || rc=$?
    if [ "$rc" -eq 0 ]; then
        say "$name: ok$([ "$output" = - ] || echo ", wrote $output")"
        return 0
    fi
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        say "$name: TIMED OUT after ${limit}s (what it wrote so far is kept)"
    else
        say "$name: FAILED (exit $rc)"
    fi
    FAILED+=("$name (exit $rc)")
    if [ "$FAIL_FAST" = 1 ]; then
        die "$name exited $rc (--fail-fast)"
    fi
}

# collect SRC NAME: copy a tool's file from the scratch folder into $OUT (when it exists).
collect() {
    if [ "$DRY_RUN" = 0 ] && [ -f "$1" ]; then
        cp "$1" "$OUT/$2"
    fi
}

plan() {
    local kernels_args=() shapes_args=()
    if [ "$QUICK" = 1 ]; then
        kernels_args=(--quick)
        shapes_args=(--batch-sizes "1,8,64" --tokens "1,6,16")
    fi
    # pytest puts the checkout root first on sys.path (pyproject.toml's pythonpath) for the
    # tests' `tests.*` and `tools.*` imports; specd then comes from the checkout's specd/,
    # whose __init__ maps the subpackages onto the same folders as the link farm.
    step gpu-tests 80 - -- "$PY" -m pytest -m gpu -q -rfEs --tb=short -p no:cacheprovider \
        tests/kernels/test_kernels_gpu.py tests/integration/test_graphs.py \
        tests/integration/test_overlap.py tests/integration/test_int4_model.py \
        tests/integration/test_kv_budget_gpu.py tests/integration/test_tensor_parallel_gpu.py
    step kernels 100 bench_kernels.json -- "$PY" -m tools.bench_kernels \
        --out "$OUT/bench_kernels.json" --group-sizes 32,128 "${kernels_args[@]}"
    step overlap 40 bench_overlap.json -- "$PY" -m tools.bench_overlap --device cuda \
        --batch-sizes 1,8 --max-tokens 32 --out "$OUT/bench_overlap.json"
    step spec 35 bench_spec.json -- "$PY" -m tools.bench_spec --device cuda --repeats 1 \
        --concurrency 1 16 64 --out "$OUT/bench_spec.json"
    step shapes 70 bench_shapes.json -- "$PY" -m tools.bench_shapes --device cuda \
        --out "$OUT/bench_shapes.json" "${shapes_args[@]}"
    step engine 20 bench_engine.json -- "$PY" -m tools.bench_engine --device cuda --rounds 1 \
        --out "$OUT/bench_engine.json"
    step daemon 20 bench_daemon.json -- "$PY" -m tools.bench_daemon --device cuda --repeats 1 \
        --out "$OUT/bench_daemon.json"
    step serving 35 bench_serving.json -- "$PY" -m tools.bench_serving \
        --daemon-args "--device cuda" --no-baseline --modes off,on --concurrency 1,16 \
        --max-tokens 64 --paired-cycles 0 --no-plots --out-dir "$SCRATCH/serving"
    collect "$SCRATCH/serving/bench_serving.json" bench_serving.json
}

# ----------------------------------------------------------------------------- set-up
# The link farm: specd/ holds links to the root package's files and one link per
# subpackage folder of pyproject.toml's package-dir (specd.daemon -> daemon/, ...); tools/
# is linked beside it, so that `python -m tools.NAME` finds the tools without the checkout
# root on sys.path.
cat >"$WORK/link_farm.py" <<'PYEOF'
import sys
import tomllib
from pathlib import Path

root, dest = Path(sys.argv[1]), Path(sys.argv[2])
dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
top = dest / "specd"
top.mkdir(parents=True, exist_ok=True)
for entry in (root / dirs["specd"]).iterdir():
    if entry.name != "__pycache__" and not (top / entry.name).exists():
        (top / entry.name).symlink_to(entry.resolve())
for package, folder in sorted(dirs.items()):
    link = dest.joinpath(*package.split("."))
    if package != "specd" and not link.exists():
        link.symlink_to((root / folder).resolve(), target_is_directory=True)
if not (dest / "tools").exists():
    (dest / "tools").symlink_to((root / "tools").resolve(), target_is_directory=True)
PYEOF
make_link_farm() { "$PY" "$WORK/link_farm.py" "$ROOT" "$SRC"; }

# Every module specd, its tools and the GPU tests import; specd itself from the link farm.
cat >"$WORK/import_check.py" <<'PYEOF'
import importlib
import sys
from pathlib import Path

src = Path(sys.argv[1]).resolve()
third_party = ["torch", "triton", "safetensors", "tokenizers", "jinja2", "zmq", "msgspec",
               "uvloop", "click", "transformers", "compressed_tensors", "pydantic",
               "hypothesis", "pytest", "matplotlib", "numpy"]
ours = ["specd", "specd.workers.engine.core", "specd.kernels.int4_gemm",
        "specd.kernels.tree_attention", "specd.kernels.mla_attention", "specd.daemon.main",
        "specd.daemon.ctl.cli", "specd.client", "tools.workload"]
missing = []
for name in third_party + ours:
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - every failure is listed
        missing.append(f"{name}: {type(exc).__name__}: {exc}")
        continue
    where = Path(getattr(module, "__file__", "") or "").parent
    print(f"  {name:<32} {getattr(module, '__version__', '')!s:<14} {where}")
specd = sys.modules.get("specd")
if specd is not None and Path(specd.__file__).parent.resolve() != (src / "specd").resolve():
    missing.append(f"specd comes from {specd.__file__}, not the link farm {src}")
if missing:
    print("missing or broken:\n  " + "\n  ".join(missing), file=sys.stderr)
    sys.exit(1)
PYEOF

setup() {
    STEP=wheels
    if [ "$WHEELS" = none ]; then
        say "wheels: none installed (WHEELS=none: the dependencies are already there)"
    else
        say "wheels: installing $WHEELS into $SITE"
        compgen -G "$WHEELS/*.whl" >/dev/null || die "no wheels in $WHEELS: run" \
            "'bash tools/fetch_gpu_wheels.sh' where pip reaches PyPI (or WHEELS=none)"
        timeout 15 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$SITE" "$WHEELS"/*.whl 2>&1 | tee -a "$LOG"
    fi

    STEP=specd
    make_link_farm
    export PYTHONPATH="$SRC:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONSAFEPATH=1  # no cwd on sys.path: ./specd alone would shadow the farm

    STEP=imports
    say "imports"
    timeout 30 "$PY" "$WORK/import_check.py" "$SRC" 2>&1 | tee -a "$LOG"

    STEP=device
    say "device"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
            2>&1 | tee -a "$LOG" || true
    fi
    timeout 15 "$PY" -c '
import sys, torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch")
p = torch.cuda.get_device_properties(0)
print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs",
      round(p.total_memory / 2**30), "GiB")' 2>&1 | tee -a "$LOG"
}

# ----------------------------------------------------------------------------- dry run
dry_run() {
    STEP=dry-run
    say "dry run: the plan's commands are checked, none is run"
    plan
    make_link_farm
    bash "$ROOT/tools/fetch_gpu_wheels.sh" --list >"$WORK/wheel_list"
    local problems=0
    PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 TRITON_INTERPRET=1 \
        "$PY" - "$ROOT" "$PLAN" "$OUT" "$SCRATCH" "$WHEELS" "$WORK/wheel_list" "$SRC" \
        "$BUDGET_S" "$SETUP_CAPS_S" "$MAX_OUT_FILES" <<'PYEOF' 2>&1 | tee -a "$LOG" || problems=$?
import argparse
import contextlib
import email.parser
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

(root, plan_dir, out, scratch, wheels, wheel_list, src, budget, setup_caps,
 max_out) = sys.argv[1:11]
root, out, scratch, src = Path(root), Path(out), Path(scratch), Path(src)
wheels = root / wheels if not Path(wheels).is_absolute() else Path(wheels)
problems: list[str] = []
# What the GPU machine's image provides: requirements these satisfy.
IMAGE = {"torch", "triton", "transformers", "safetensors", "tokenizers", "jinja2", "uvloop",
         "click", "psutil", "sortedcontainers", "attrs", "numpy", "pytest", "matplotlib",
         "packaging", "filelock", "huggingface-hub", "pyyaml", "regex", "requests", "tqdm",
         "typing-extensions", "colorama"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- wheels: exactly the fetch list, for CPython 3.12 manylinux x86_64, requirements met
try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # pip's vendored copy
    from pip._vendor.packaging.markers import default_environment  # type: ignore
    from pip._vendor.packaging.requirements import Requirement  # type: ignore

pinned = {}
for line in Path(wheel_list).read_text().split():
    name, version = line.split("==")
    pinned[norm(name)] = version
files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
if not files:
    problems.append(f"no wheels in {wheels}: run 'bash tools/fetch_gpu_wheels.sh' (they must "
                    "be fetched and carried for the GPU machine)")
found: dict[str, Path] = {}
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3",
                               "implementation_name": "cpython", "sys_platform": "linux",
                               "platform_system": "Linux", "platform_machine": "x86_64",
                               "os_name": "posix", "extra": ""}
for f in files:
    parts = f.name[:-4].split("-")
    name, version, py, abi, plats = norm(parts[0]), parts[1], parts[-3], parts[-2], parts[-1]
    if name in found:
        problems.append(f"two wheels of {name}: {found[name].name}, {f.name}")
    found[name] = f
    if name not in pinned:
        problems.append(f"{f.name} is not in fetch_gpu_wheels.sh's list")
    elif pinned[name] != version:
        problems.append(f"{f.name}: version {version}, the list pins {pinned[name]}")
    pys, abis = py.split("."), abi.split(".")
    cp312 = ("cp312" in pys and "cp312" in abis) or ("none" in abis and any(
        p in ("py3", "py312", "cp312") for p in pys)) or ("abi3" in abis and any(
        re.fullmatch(r"cp3(\d+)", p) and int(p[3:]) <= 12 for p in pys))
    platform_ok = any(p == "any" or (p.endswith("_x86_64") and (
        p.startswith(("manylinux1", "manylinux2010", "manylinux2014")) or (
            re.match(r"manylinux_2_(\d+)_", p) and int(p.split("_")[2]) <= 35)))
        for p in plats.split("."))
    if not (cp312 and platform_ok):
        problems.append(f"{f.name} does not install on CPython 3.12 manylinux x86_64")
    with zipfile.ZipFile(f) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
    for text in meta.get_all("Requires-Dist") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        dep = norm(req.name)
        if dep in pinned:
            if not req.specifier.contains(pinned[dep], prereleases=True):
                problems.append(f"{f.name} needs {text}; the list pins {dep}=={pinned[dep]}")
        elif dep not in IMAGE:
            problems.append(f"{f.name} needs {text}: neither carried nor on the GPU image")
for name in pinned:
    if name not in found and files:
        problems.append(f"{name}=={pinned[name]} is listed but its wheel is not in {wheels}")
print(f"wheels: {len(files)} in {wheels}, "
      f"{sum(f.stat().st_size for f in files) / 2**20:.1f} MiB")

# --- the plan
steps = []
for path in sorted(Path(plan_dir).iterdir()):
    fields = path.read_bytes().split(b"\0")[:-1]
    name, cap, output, *argv = (x.decode() for x in fields)
    steps.append({"name": name, "cap": int(cap), "output": output, "argv": argv})

outputs = [s["output"] for s in steps if s["output"] != "-"]
if len(outputs) + 1 > int(max_out):
    problems.append(f"{len(outputs) + 1} files in $OUT (the log and {outputs}): a device "
                    f"run brings back at most {max_out}")
if len(set(outputs)) != len(outputs):
    problems.append(f"two steps write the same file: {outputs}")
total = int(setup_caps) + sum(s["cap"] for s in steps)
if total > int(budget) or int(budget) > 480:
    problems.append(f"the limits add up to {total} s (set-up {setup_caps} s), over the "
                    f"{budget} s budget or the 8-minute target")
child_env = os.environ.copy()


def check_pytest(s: dict) -> str:
    args = s["argv"][3:]
    files = [a for a in args if a.startswith("tests/")]
    for f in files:
        if not (root / f.split("::")[0]).is_file():
            return f"test file {f} does not exist"
    if not files:
        return "names no test file"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *args],
                          cwd=root, capture_output=True, text=True, env=child_env)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    if proc.returncode != 0:
        return f"pytest --collect-only exit {proc.returncode}: {' | '.join(tail)}"
    # -q prints one node id a line and "N/M tests collected"; -qq "file: count" lines.
    per_file = {m.group(1): int(m.group(2))
                for m in re.finditer(r"^(tests/\S+?\.py): (\d+)$", proc.stdout, re.M)}
    for m in re.finditer(r"^(tests/\S+?\.py)::", proc.stdout, re.M):
        per_file[m.group(1)] = per_file.get(m.group(1), 0) + 1
    empty = [f for f in files if per_file.get(f.split("::")[0], 0) == 0]
    if empty:
        return f"selects no test in {', '.join(empty)}: {' | '.join(tail)}"
    return f"ok ({sum(per_file.values())} tests in {len(files)} files)"


results = {}
tool_steps = []
for s in steps:
    argv = s["argv"]
    if argv[1:3] == ["-m", "pytest"]:
        results[s["name"]] = check_pytest(s)
    elif argv[1:2] == ["-m"] and len(argv) > 2 and argv[2].startswith("tools."):
        if not (root / (argv[2].replace(".", "/") + ".py")).is_file():
            results[s["name"]] = f"{argv[2]} does not exist"
        else:
            tool_steps.append(s)
    else:
        results[s["name"]] = f"unknown kind of command: {shlex.join(argv)}"

# Every tool's flags, parsed by its own parser in one process (imports shared): argparse's
# parse_args and click's leaf commands stop right after parsing; a private daemon's flags
# (bench_serving's --daemon-args, bench_daemon's DaemonProcess) are parsed by specd's own.
ARGCHECK = r'''
import argparse, contextlib, io, json, runpy, shlex, sys
import click

class ArgsOK(Exception):
    pass

record = {}
real_parse_args = argparse.ArgumentParser.parse_args
real_invoke = click.Command.invoke

def parse_args(self, args=None, namespace=None):
    ns = real_parse_args(self, args, namespace)
    record["device_option"] = "--device" in self._option_string_actions
    record["params"] = {k: str(v) for k, v in vars(ns).items()}
    raise ArgsOK

def invoke(self, ctx):
    if isinstance(self, click.Group):
        return real_invoke(self, ctx)
    record["device_option"] = any("--device" in p.opts for p in self.params)
    record["params"] = {k: str(v) for k, v in ctx.params.items()}
    if "daemon_args" in ctx.params:
        check_daemon(shlex.split(ctx.params["daemon_args"] or ""))
    raise ArgsOK

def check_daemon(extra):
    from specd.daemon.main import main as specd_main
    ctx = specd_main.make_context("specd", ["--socket", "/nonexistent.sock", *extra])
    record["daemon_device"] = str(ctx.params.get("device"))

class FakeDaemon:
    def __init__(self, model, extra):
        check_daemon([*(["--model", model] if model else []), *extra])
        raise ArgsOK

real_main = click.Command.main

def main(self, *args, **kwargs):  # usage errors raised, not printed and exited
    kwargs["standalone_mode"] = False
    return real_main(self, *args, **kwargs)

argparse.ArgumentParser.parse_args = parse_args
click.Command.invoke = invoke
click.Command.main = main
from tools import bench_daemon
bench_daemon.DaemonProcess = FakeDaemon
results = []
for spec in json.loads(sys.argv[1]):
    record.clear()
    sys.argv = [spec["argv"][2], *spec["argv"][3:]]  # run_module sets argv[0] to the file
    err = io.StringIO()
    status = "ok"
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_module(spec["argv"][2], run_name="__main__", alter_sys=True)
        status = "ran past its argument parsing"
    except ArgsOK:
        pass
    except SystemExit as exc:
        lines = err.getvalue().strip().splitlines() or [""]
        status = f"exit {exc.code}: {lines[-1][-600:]}"  # argparse's "prog: error: ..." line
    except click.ClickException as exc:
        status = f"{type(exc).__name__}: {exc.format_message()}"
    except Exception as exc:
        status = f"{type(exc).__name__}: {exc}"
    results.append({"name": spec["name"], "status": status, **record})
print("ARGCHECK " + json.dumps(results))
'''
if tool_steps:
    proc = subprocess.run([sys.executable, "-c", ARGCHECK, json.dumps(tool_steps)],
                          cwd=root, capture_output=True, text=True, env=child_env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ARGCHECK ")), None)
    if line is None:
        for s in tool_steps:
            results[s["name"]] = f"argument check crashed: {proc.stderr.strip()[-800:]}"
    else:
        by_name = {s["name"]: s for s in tool_steps}
        for r in json.loads(line[len("ARGCHECK "):]):
            s, message = by_name[r["name"]], r["status"]
            params = r.get("params", {})
            if message == "ok":
                if r.get("device_option") and not params.get("device", "").startswith("cuda"):
                    message = f"runs on {params.get('device')}: pass --device cuda"
                elif "daemon_device" in r and not r["daemon_device"].startswith("cuda"):
                    message = (f"its daemon runs on {r['daemon_device']}: pass --device cuda "
                               "in --daemon-args")
                elif "out" in params and s["output"] != "-" and \
                        Path(params["out"]) != out / s["output"]:
                    message = f"writes {params['out']}, not $OUT/{s['output']}"
                elif "out_dir" in params and not Path(params["out_dir"]).is_relative_to(
                        scratch) and not Path(params["out_dir"]).is_relative_to(out):
                    message = f"writes into {params['out_dir']}, outside $OUT"
                else:
                    message = "ok (flags parsed" + (", --device cuda" if r.get(
                        "device_option") or "daemon_device" in r else "") + ")"
            results[r["name"]] = message

for s in steps:
    status = results.get(s["name"], "not checked")
    if not status.startswith("ok"):
        problems.append(f"step {s['name']}: {status}")
    print(f"  {s['name']:<10} {s['cap']:>4}s  {s['output']:<20} {status}")
print(f"limits: set-up {setup_caps} s + steps {sum(s['cap'] for s in steps)} s = {total} s "
      f"(budget {budget} s); files in $OUT: {len(outputs) + 1} (at most {max_out})")
if problems:
    print("dry run: FAILED\n  " + "\n  ".join(problems))
    sys.exit(1)
print("dry run: ok")
PYEOF
    if [ "$problems" -ne 0 ]; then
        die "the plan does not hold (above)"
    fi
    STEP=specd
    say "specd from the link farm"
    PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 TRITON_INTERPRET=1 \
        timeout 120 "$PY" "$WORK/import_check.py" "$SRC" 2>&1 | tee -a "$LOG"
    say "dry run: ok"
}

# ----------------------------------------------------------------------------- main
if [ "$DRY_RUN" = 1 ]; then
    dry_run
    exit 0
fi
say "gpu_check in $ROOT, results in $OUT"
setup
plan
STEP=finish
say "done: $(elapsed)s of ${BUDGET_S}s"
find "$OUT" -maxdepth 2 -type f -printf '%10s  %p\n' | sort -k2 | tee -a "$LOG"
if [ "${#SKIPPED[@]}" -gt 0 ]; then
    say "skipped (out of time): ${SKIPPED[*]}"
fi
if [ "${#FAILED[@]}" -gt 0 ]; then
    say "FAILED: ${FAILED[*]}"
    exit 1
fi
