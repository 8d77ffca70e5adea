#!/usr/bin/env bash
# Download the wheels tools/gpu_check.sh installs on a GPU machine that has no network.
#
# The GPU machine (docs/benchmarks.md, "GPU check") runs Python 3.12 with torch, triton,
# transformers, safetensors, tokenizers, jinja2, uvloop, click, pytest and matplotlib
# installed, and none of the packages below (hypothesis is listed there, but carried in case).
# This script fetches each as a CPython 3.12 manylinux x86_64 wheel (or a pure-Python one),
# without dependencies: the list names every dependency the image lacks, pinned to the
# versions this project's CI tests with. gpu_check.sh --dry-run checks that the folder holds
# exactly these wheels, for cp312, and that each wheel's requirements are met by the folder or
# the image.
#
#   bash tools/fetch_gpu_wheels.sh [DEST]   # default DEST: tools/gpu_wheels (committed: ~4.6 MB)
#   bash tools/fetch_gpu_wheels.sh --list   # the pinned list, one name==version a line
#
# Needs pip and PyPI (any Python version can download for 3.12).
set -euo pipefail

# name==version  # why it is needed
WHEELS=(
    "pyzmq==27.3.0"               # specd.ipc: the ZeroMQ link between front and scheduler
    "msgspec==0.23.0"             # specd.ipc: messages
    "compressed-tensors==0.20.1"  # INT4 checkpoints through transformers (tests, quantize)
    "pydantic==2.13.4"            # compressed-tensors
    "pydantic-core==2.46.4"       # pydantic (pinned by it)
    "annotated-types==0.7.0"      # pydantic
    "typing-inspection==0.4.2"    # pydantic
    "typing-extensions==4.16.0"   # pydantic needs >= 4.14.1; torch's may be older
    "loguru==0.7.3"               # compressed-tensors
    "hypothesis==6.155.2"         # the test suite's property tests
)

if [ "${1:-}" = "--list" ]; then
    printf '%s\n' "${WHEELS[@]}"
    exit 0
fi
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi

cd "$(dirname "$0")/.."
DEST=${1:-tools/gpu_wheels}
PY=${PYTHON:-python3}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

echo "fetch_gpu_wheels: downloading ${#WHEELS[@]} wheels for CPython 3.12 manylinux x86_64"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$TMP" "${WHEELS[@]}"

count=$(find "$TMP" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
    echo "fetch_gpu_wheels: expected ${#WHEELS[@]} wheels, got $count" >&2
    exit 1
fi
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two would stop the install
mv "$TMP"/*.whl "$DEST"/
ls -l "$DEST"
wheel_bytes=$(find "$DEST" -maxdepth 1 -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s}')
echo "fetch_gpu_wheels: $count wheels, $((wheel_bytes / 1024)) KiB in $DEST"
# What travels to the GPU machine: tracked and untracked-but-not-ignored files, 64 MiB at most.
if git rev-parse --git-dir >/dev/null 2>&1; then
    tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } \
        | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
    echo "fetch_gpu_wheels: the working tree that travels is $((tree_bytes / 1048576)) MiB" \
         "(limit 64 MiB)"
    if [ "$tree_bytes" -gt $((64 * 1048576)) ]; then
        echo "fetch_gpu_wheels: over the 64 MiB a device run carries" >&2
        exit 1
    fi
fi
