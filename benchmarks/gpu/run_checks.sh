#!/usr/bin/env bash
# The GPU checks on a machine with no package index, from the repository root:
#
#     bash benchmarks/gpu/run_checks.sh
#
# Needs .gpu/pack.tar.xz (benchmarks/gpu/pack_offline.py) beside the checkout and the
# device's image (Python 3.12, torch 2.11.0+cu130, transformers, pytest). Nothing is fetched:
# the pack is unpacked into /tmp/site and put on PYTHONPATH with the checkout, which is not
# installed (no entry point or installed metadata is needed: `fabric.version` falls back to
# `fabric.__version__`, discovery imports modules by name, workers start as `python -m`).
# Each stage prints a `stage NAME: rc=N, S s` line; each pytest's output also goes to
# $OUT/NAME.log. The exit status is the number of failed stages.
set -u -o pipefail

OUT=${OUT:-/tmp/gpu-checks}
PACK=${PACK:-.gpu/pack.tar.xz}
SITE=/tmp/site
MODEL=/tmp/tiny-qwen2
mkdir -p "$OUT"

export PYTHONUNBUFFERED=1
# no network there: fail at once instead of waiting on Hugging Face, usage reporting or pip
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0
export PIP_NO_INDEX=1
export RAY_AUTH_MODE=disabled

failed=0
stage() {  # stage NAME CMD...: run CMD, print its status and seconds
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    echo "=== $name ($(date -u +%H:%M:%S))"
    "$@"
    rc=$?
    echo "stage $name: rc=$rc, $(($(date +%s) - t0)) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
    return 0
}

unpack() {
    [ -f "$PACK" ] || { echo "no $PACK: build it with benchmarks/gpu/pack_offline.py"; return 1; }
    rm -rf "$SITE" && mkdir -p "$SITE" || return 1
    if command -v xz >/dev/null; then
        tar -xJf "$PACK" -C "$SITE"
    else  # the same archive through Python's lzma
        python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' "$PACK" "$SITE"
    fi && du -sh "$SITE"
}

versions() {
    python3 --version
    nvidia-smi -L || echo "nvidia-smi -L failed"
    python3 - <<'EOF'
import importlib

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("vllm", "ray", "megatron.core", "pydantic", "transformers"):
    mod = importlib.import_module(name)
    print(name, getattr(mod, "__version__", "?"), "from", mod.__file__)
# the checkout, from PYTHONPATH (not installed)
import core, envpool, fabric, functions  # noqa: E401,F401

print("rl-fabric", fabric.__version__, "from", fabric.__file__)
EOF
}

pytest_log() {  # pytest_log NAME ARGS...: pytest, its output also in $OUT/NAME.log
    local name=$1
    shift
    python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/$name.log"
}

stage unpack unpack
export PYTHONPATH=$SITE:$PWD
stage versions versions
stage tiny_model python3 benchmarks/gpu/make_tiny_hf_model.py "$MODEL"
export RL_FABRIC_VLLM_TEST_MODEL=$MODEL
# GPU_TESTS picks modules for a rerun (device time is short); a test past 240 s (a vLLM start
# that hangs) fails rather than take the rest of the call's time
read -r -a tests <<<"${GPU_TESTS:-tests/core/test_megatron_trainer.py tests/core/test_vllm_engine.py tests/core/test_job_gpu.py}"
stage gpu_tests pytest_log gpu_tests -m gpu --timeout 240 "${tests[@]}"
# its tensors are the CPU's (the module has no CUDA case): it checks the lean path under the
# device's torch build
[ "${LEAN:-1}" = 0 ] || stage lean_logprobs pytest_log lean_logprobs tests/core/test_lean_logprobs.py
echo "failed stages: $failed"
exit "$failed"
