#!/usr/bin/env bash
# The one device check of specd on a bare GPU machine (an H200: Python 3.12, torch, triton,
# transformers; no network; a cold Triton cache), in at most 420 seconds. Run from anywhere:
#
#   OUT=/some/dir bash tools/gpu_check.sh [--fail-fast]
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
# Measurements, most valuable first, each under its own time limit (`timeout`) and verbose,
# each writing its JSON into $OUT as it goes (rewritten after every part, so a step cut short
# keeps what it measured). One Triton cache serves every step, so a kernel one step compiled
# is not compiled again by the next (the GEMM configurations of the Llama shapes, the
# fixture's attention):
#   gpu-tests  pytest -v over a trimmed list of GPU tests (kernels at production sizes, graphs
#              and overlap, the KV budget, float32 on CUDA, INT4 on CUDA; on a machine with
#              two GPUs or more, tensor parallelism over NCCL, last: it skips itself on one),
#              each test limited to $TEST_TIMEOUT_S (tests/conftest.py), outcomes in
#              gpu_tests.json
#   kernels    tools/bench_kernels.py: copy bandwidth; the INT4 GEMV/GEMM at group 32 on
#              Llama-3.1-8B's four linears at M = 1, 4, 16, 64 against bf16 matmul, as the
#              median and worst share of measured and nominal HBM bandwidth per M; the fused
#              INT4 MoE at one TP8 rank's Kimi-K2 shapes for 1-64 tokens, us per layer
#   host       tools/bench_host.py: an INT4 Llama-3.1-8B-shaped checkpoint and its EAGLE-3
#              head written at start (random, generated on the GPU), one EngineCore over
#              them: host us per step at batch 1 and 8, plain and speculative, and the batch-1
#              speculative speed-up from the engine's own draft loop
#   daemon     tools/bench_daemon.py: daemon overhead against the in-process engine
#   serving    tools/bench_serving.py: the serving sweep (JSON copied into $OUT)
# A failed or timed-out measurement is reported at once by name and the next one runs (the
# machine is lent for minutes: one broken benchmark must not cost the others' figures); the
# script then exits 1 naming them. --fail-fast stops at the first one instead. A step that
# would start with less than 15 s of the budget left is skipped and named.
#
# $OUT (default bench_out/gpu_check) receives at most 8 files: gpu_check.log, gpu_check.json
# (each step's limit, estimate, exit, seconds and figures, rewritten after every step) and one
# JSON per measurement. The step limits and the set-up's add up to at most $BUDGET_S seconds.
#
# --dry-run runs no measurement: it checks that the carried wheels are exactly
# fetch_gpu_wheels.sh's list, for CPython 3.12 on manylinux x86_64, with every requirement met
# by the folder or the GPU image; that the link farm imports specd; that every command of
# the plan parses its flags (each tool's own argparse or click parser, the private daemon's
# `specd` flags included), passes --device cuda where the tool has a device, and writes under
# $OUT; that every test file it names exists and holds GPU tests; that each step's estimate
# (from its counts: the tests it collects, or the compiles, timings, engine builds and
# checkpoint bytes its tool's --plan reports, or the counts the plan declares, times the
# per-item costs below) fits its limit, and the limits the budget; that each step's figures
# are those its tool says it writes; and that the files fit. It prints the plan as a table.
# Any problem fails it (exit 1).
set -Eeuo pipefail

usage() { sed -n '2,53p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

DRY_RUN=0
FAIL_FAST=0
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
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
BUDGET_S=420           # every limit below added up: the run's 7 minutes
SETUP_CAPS_S=60        # wheels 10 + imports 40 (about 10 on the H200; a loaded CPU needs more) + device 10
TEST_TIMEOUT_S=60      # one GPU test (setup and call each), then the next runs
MAX_OUT_FILES=8        # what a device run brings back
# What one item costs on the H200, for the dry run's estimates (seconds): a process's imports
# (torch, triton, specd), a cold Triton compile (0.5-1.5 s each on an idle host: the worst),
# a `do_bench` timing, building a fixture engine on the GPU (load, profile, graph capture),
# one engine step, one GPU test (its engine builds and small compiles), a GB of checkpoint
# generated, written and loaded.
COSTS="import_s=12 compile_s=1.5 bench_s=0.3 engine_s=6 step_s=0.02 test_s=4 gb_s=4"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/specd_gpu_check.XXXXXX")
SITE=$WORK/site        # the carried wheels, installed
SRC=$WORK/src          # the specd link farm
SCRATCH=$WORK/scratch  # tool outputs that are not copied into $OUT whole
PLAN=$WORK/plan        # the dry run's record of each planned command
RESULTS=$WORK/results  # one line per finished step, for gpu_check.json
if [ "$DRY_RUN" = 1 ]; then
    OUT=$WORK/out
else
    OUT=${OUT:-bench_out/gpu_check}
fi
mkdir -p "$OUT" "$SITE" "$SRC" "$SCRATCH" "$PLAN" "$RESULTS"
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
export TRITON_CACHE_DIR=$WORK/triton  # one cache for every step: compiled once per run
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# Read by tests/conftest.py in the gpu-tests step: the limit per test and its JSON report.
export SPECD_TEST_TIMEOUT_S=$TEST_TIMEOUT_S SPECD_TEST_REPORT=$OUT/gpu_tests.json

say() { printf '== %s (%ss)\n' "$*" "$(($(date +%s) - START))" | tee -a "$LOG"; }
die() { echo "gpu_check: FAILED at step \"$STEP\": $*" | tee -a "$LOG" >&2; trap - ERR; exit 1; }
elapsed() { echo $(($(date +%s) - START)); }

# ----------------------------------------------------------------------------- the plan
# step NAME LIMIT_S OUTPUT FIGURES COUNTS -- COMMAND...: one measurement. OUTPUT is the file it
# leaves in $OUT ("-": none); FIGURES, comma-separated, what it measures (a tool with --plan
# must say the same); COUNTS ("-": none) the items the dry run's estimate counts where the
# command cannot tell (key=value,...: engine_builds, benches, compiles, fixed_s). The dry run
# records the command instead of running it.
step() {
    local name=$1 cap=$2 output=$3 figures=$4 counts=$5
    shift 6
    STEP_COUNT=$((STEP_COUNT + 1))
    if [ "$DRY_RUN" = 1 ]; then
        printf '%s\0' "$name" "$cap" "$output" "$figures" "$counts" "$@" \
            >"$PLAN/$(printf '%02d' "$STEP_COUNT")"
        return 0
    fi
    STEP=$name
    local left limit rc=0 began status
    left=$((BUDGET_S - $(elapsed)))
    if [ "$left" -lt 15 ]; then
        say "skip $name: ${left}s of the ${BUDGET_S}s budget left"
        SKIPPED+=("$name")
        record "$name" "$cap" skipped 0 0 "$output" "$figures"
        return 0
    fi
    limit=$((cap < left ? cap : left))
    say "$name (limit ${limit}s)"
    echo "\$ $*" >>"$LOG"
    began=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG" || rc=$?
    if [ "$rc" -eq 0 ]; then
        status=ok
        say "$name: ok$([ "$output" = - ] || echo ", wrote $output")"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status=timed-out
        say "$name: TIMED OUT after ${limit}s (what it wrote so far is kept)"
    else
        status=failed
        say "$name: FAILED (exit $rc)"
    fi
    record "$name" "$cap" "$status" "$rc" "$(($(date +%s) - began))" "$output" "$figures"
    if [ "$rc" -ne 0 ]; then
        FAILED+=("$name (exit $rc)")
        if [ "$FAIL_FAST" = 1 ]; then
            die "$name exited $rc (--fail-fast)"
        fi
    fi
}

# record NAME CAP STATUS RC SECONDS OUTPUT FIGURES: one finished step, and gpu_check.json
# rewritten from every step so far (a run cut short keeps the steps it finished).
record() {
    printf '{"name": "%s", "limit_s": %s, "status": "%s", "exit": %s, "seconds": %s, ' \
        "$1" "$2" "$3" "$4" "$5" >"$RESULTS/$(printf '%02d' "$STEP_COUNT")"
    printf '"output": "%s", "figures": "%s"}\n' "$6" "$7" >>"$RESULTS/$(printf '%02d' \
        "$STEP_COUNT")"
    {
        printf '{"budget_s": %s, "elapsed_s": %s, "steps": [\n' "$BUDGET_S" "$(elapsed)"
        local first=1 f
        for f in "$RESULTS"/*; do
            [ "$first" = 1 ] || printf ',\n'
            first=0
            tr -d '\n' <"$f"
        done
        printf '\n]}\n'
    } >"$OUT/gpu_check.json"
}

# collect SRC NAME: copy a tool's file from the scratch folder into $OUT (when it exists).
collect() {
    if [ "$DRY_RUN" = 0 ] && [ -f "$1" ]; then
        cp "$1" "$OUT/$2"
    fi
}

# The trimmed GPU tests: production-size kernels (a few M per branch, not every M), graphs
# and overlap against eager, the KV budget, float32 and INT4 on CUDA. Each engine test builds
# fixture engines in seconds; the list is sized to the step's limit (the dry run checks it).
GPU_TESTS=(
    "tests/kernels/test_kernels_gpu.py::test_int4_gemm_matches_reference_on_gpu[column_major-4096-14336-32-1]"
    "tests/kernels/test_kernels_gpu.py::test_int4_gemm_matches_reference_on_gpu[column_major-4096-14336-32-17]"
    "tests/kernels/test_kernels_gpu.py::test_int4_gemm_matches_reference_on_gpu[column_major-4096-14336-32-65]"
    "tests/kernels/test_kernels_gpu.py::test_int4_gemm_matches_reference_on_gpu[checkpoint-7168-2048-32-1]"
    "tests/kernels/test_kernels_gpu.py::test_tree_attention_matches_reference_on_gpu[None]"
    "tests/kernels/test_kernels_gpu.py::test_tree_attention_matches_reference_on_gpu[4]"
    "tests/kernels/test_moe_w4a16.py::test_kernel_matches_reference_on_gpu[32-True-1]"
    "tests/kernels/test_moe_w4a16.py::test_kernel_matches_reference_on_gpu[32-True-64]"
    "tests/integration/test_graphs.py::test_cuda_graphs_give_the_eager_output_at_captured_sizes"
    "tests/integration/test_graphs.py::test_a_failed_cuda_capture_is_reported"
    "tests/integration/test_overlap.py::test_overlap_on_cuda_gives_the_whole_step_output[chain]"
    "tests/integration/test_overlap.py::test_overlap_on_cuda_gives_the_whole_step_output[tree]"
    "tests/integration/test_kv_budget_gpu.py"
    "tests/integration/test_float32_cuda.py"
    "tests/integration/test_int4_model.py::test_int4_model_on_cuda_matches_the_cpu_path[llama]"
    # Size 2 over NCCL against size 1 (MoE fixture, speculation on: MLA heads and experts
    # split, drafts verified sharded, step inputs through the ring and a device broadcast);
    # skipped with fewer than two GPUs. Its rank 1 is a fresh interpreter: the step counts
    # one process's imports more for it (fixed_s below).
    "tests/integration/test_tensor_parallel_gpu.py::test_size_two_over_nccl_generates_the_size_one_tokens[fixture-moe-options2]"
)

plan() {
    # pytest puts the checkout root first on sys.path (pyproject.toml's pythonpath) for the
    # tests' `tests.*` and `tools.*` imports; specd then comes from the checkout's specd/,
    # whose __init__ maps the subpackages onto the same folders as the link farm.
    step gpu-tests 115 gpu_tests.json gpu_tests fixed_s=12 -- "$PY" -m pytest -v -m gpu -rfEs \
        --tb=short -p no:cacheprovider "${GPU_TESTS[@]}"
    step kernels 70 bench_kernels.json bandwidth,gemm_summary,moe_summary - -- \
        "$PY" -m tools.bench_kernels --out "$OUT/bench_kernels.json" \
        --parts bandwidth,gemm,moe --group-sizes 32 --gemm-m 1,4,16,64 \
        --gemm-shapes llama3.1-8b --layouts column_major --moe-tp 8 --no-moe-extras
    step host 105 bench_host.json host_us_per_step,step_us,host_share,speedup_bs1 - -- \
        "$PY" -m tools.bench_host --device cuda --out "$OUT/bench_host.json" \
        --batch-sizes 1,8 --steps 32 --group-size 32 --work "$SCRATCH/host"
    step daemon 30 bench_daemon.json daemon_overhead engine_builds=2,fixed_s=5 -- \
        "$PY" -m tools.bench_daemon --device cuda --repeats 1 --out "$OUT/bench_daemon.json"
    step serving 40 bench_serving.json serving_sweep engine_builds=1,fixed_s=20 -- \
        "$PY" -m tools.bench_serving --daemon-args "--device cuda" --no-baseline \
        --modes off,on --concurrency 1,16 --max-tokens 64 --paired-cycles 0 \
        --no-plots --out-dir "$SCRATCH/serving"
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
        timeout 10 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$SITE" "$WHEELS"/*.whl 2>&1 | tee -a "$LOG"
    fi

    STEP=specd
    make_link_farm
    export PYTHONPATH="$SRC:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONSAFEPATH=1  # no cwd on sys.path: ./specd alone would shadow the farm

    STEP=imports
    say "imports"
    timeout 40 "$PY" "$WORK/import_check.py" "$SRC" 2>&1 | tee -a "$LOG"

    STEP=device
    say "device"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
            2>&1 | tee -a "$LOG" || true
    fi
    timeout 10 "$PY" -c '
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
        "$BUDGET_S" "$SETUP_CAPS_S" "$MAX_OUT_FILES" "$COSTS" <<'PYEOF' 2>&1 | tee -a "$LOG" \
        || problems=$?
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
 max_out, costs_text) = sys.argv[1:12]
COSTS = {k: float(v) for k, v in (x.split("=") for x in costs_text.split())}
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
    name, cap, output, figures, counts, *argv = (x.decode() for x in fields)
    declared = {} if counts == "-" else {
        k: float(v) for k, v in (x.split("=") for x in counts.split(","))}
    steps.append({"name": name, "cap": int(cap), "output": output, "argv": argv,
                  "figures": [f for f in figures.split(",") if f], "counts": declared})

outputs = [s["output"] for s in steps if s["output"] != "-"]
if len(outputs) + 2 > int(max_out):
    problems.append(f"{len(outputs) + 2} files in $OUT (the log, gpu_check.json and "
                    f"{outputs}): a device run brings back at most {max_out}")
if len(set(outputs)) != len(outputs):
    problems.append(f"two steps write the same file: {outputs}")
total = int(setup_caps) + sum(s["cap"] for s in steps)
if total > int(budget) or int(budget) > 420:
    problems.append(f"the limits add up to {total} s (set-up {setup_caps} s), over the "
                    f"{budget} s budget or the 420 s a run may take")
child_env = os.environ.copy()


def estimate(counts: dict) -> tuple[float, str]:
    """Seconds a step takes from its counts (COSTS per item), and how they add up."""
    parts = {"imports": COSTS["import_s"],
             "compiles": counts.get("compiles", 0) * COSTS["compile_s"],
             "timings": counts.get("benches", 0) * COSTS["bench_s"],
             "engines": counts.get("engine_builds", 0) * COSTS["engine_s"],
             "steps": counts.get("engine_steps", 0) * COSTS["step_s"],
             "tests": counts.get("tests", 0) * COSTS["test_s"],
             "checkpoint": counts.get("checkpoint_bytes", 0) / 1e9 * COSTS["gb_s"],
             "fixed": counts.get("fixed_s", 0)}
    text = " + ".join(f"{k} {v:.0f}" for k, v in parts.items() if v)
    return sum(parts.values()), text


def check_pytest(s: dict) -> str:
    args = s["argv"][3:]
    files = [a for a in args if a.startswith("tests/")]
    for f in files:
        if not (root / f.split("::")[0]).is_file():
            return f"test file {f} does not exist"
    if not files:
        return "names no test file"
    quiet = [a for a in args if a not in ("-v", "--verbose")]  # one node id a line
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *quiet],
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
    s["counts"] = {**s["counts"], "tests": sum(per_file.values())}
    return f"ok ({sum(per_file.values())} tests, {len(set(per_file))} files)"


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
            s["params"] = params
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

# Each tool with a --plan flag reports what it will compile, time and build, and its figures.
for s in tool_steps:
    if not results.get(s["name"], "").startswith("ok") or "plan" not in s.get("params", {}):
        continue
    proc = subprocess.run([sys.executable, *s["argv"][1:], "--plan"], cwd=root,  # -m tools.X
                          capture_output=True, text=True, env=child_env)
    try:
        reported = json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        results[s["name"]] = f"--plan gave no JSON: {(proc.stdout + proc.stderr)[-400:]}"
        continue
    s["counts"] = {**s["counts"], **{k: v for k, v in reported.items() if k != "figures"}}
    if sorted(reported.get("figures", [])) != sorted(s["figures"]):
        results[s["name"]] = (f"writes figures {reported.get('figures')}, the plan says "
                              f"{s['figures']}")

print(f"  {'step':<10} {'limit':>5} {'estimate':>8}  {'output':<19} {'figures':<40} status")
for s in steps:
    status = results.get(s["name"], "not checked")
    if not status.startswith("ok"):
        problems.append(f"step {s['name']}: {status}")
    seconds, how = estimate(s["counts"])
    s["estimate"] = seconds
    if status.startswith("ok") and seconds > s["cap"]:
        problems.append(f"step {s['name']}: estimated {seconds:.0f} s ({how}), over its "
                        f"{s['cap']} s limit")
    if not s["figures"]:
        problems.append(f"step {s['name']}: names no figure")
    print(f"  {s['name']:<10} {s['cap']:>4}s {seconds:>7.0f}s  {s['output']:<19} "
          f"{','.join(s['figures']):<40} {status}")
    print(f"  {'':<10} {'':>5} {'':>8}  = {how}")
estimated = int(setup_caps) + sum(s.get("estimate", 0) for s in steps)
print(f"limits: set-up {setup_caps} s + steps {sum(s['cap'] for s in steps)} s = {total} s "
      f"(budget {budget} s); estimated {estimated:.0f} s; files in $OUT: "
      f"{len(outputs) + 2} (at most {max_out})")
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
