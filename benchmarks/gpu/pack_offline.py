"""Builds the package pack that lets the GPU tests run on a machine with no package index.

    python benchmarks/gpu/pack_offline.py                  # writes .gpu/pack.tar.xz
    python benchmarks/gpu/pack_offline.py --out /tmp/p.tar.xz --work /tmp/pack-work

The GPU machine (Python 3.12, torch 2.11.0+cu130 and the packages of its image already there)
takes at most 64 MiB per call with the repository, so the pack must stay under 58.5 MiB. It is a
plain ``site-packages`` tree as ``tar.xz``: ``benchmarks/gpu/run_checks.sh`` unpacks it into
/tmp/site and puts that on ``PYTHONPATH`` (no pip there, no install step).

What goes in: vLLM 0.24.0, Ray 2.60.0 and megatron-core 0.19.2 (the versions the GPU
checks of the README ran with), rl-fabric's own dependencies the image lacks (pydantic,
tenacity), pytest-asyncio, and the closure of their ``Requires-Dist`` less what the image has
(``DEVICE_HAS``) and less vLLM's optional kernel packages (``OPTIONAL``). The versions are
pinned (``PINS``); ``--resolve`` prints the closure as PyPI has it now, to refresh them.

What comes out, and why that is safe, is said at each trim below. The two big libraries are
vLLM's flash-attention 3 kernels and ``_C_stable_libtorch``: their CUDA code for other GPUs
than the H100/H200 (sm_90) is zeroed in place (see ``zero_fatbins``), which xz then packs to
nothing.

Needs: pip (it downloads the wheels from PyPI), ``readelf``, ``strip`` and ``tar`` with xz.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the carry limit is 64 MiB with the working tree; the tracked repository takes about 5.4 MB
LIMIT_MIB = 58.5

#: the device's Python: wheels are chosen for it, not for the interpreter running this script
PY = "3.12"
PLATFORMS = [
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
    "any",
]

ROOTS = [
    "vllm==0.24.0",
    "ray==2.60.0",
    "megatron-core==0.19.2",
    # rl-fabric's own dependencies the image lacks (typer, rich, httpx and pyyaml are there)
    "pydantic>=2.7,<3",
    "tenacity>=9.2",
    # test_vllm_engine.py's tests are coroutines (pyproject: asyncio_mode = "auto")
    "pytest-asyncio>=0.23",
]

#: ``--resolve`` as of 2026-11-28: ROOTS and the closure of their requirements, less
#: DEVICE_HAS and OPTIONAL
PINS = """
annotated-types==0.8.0 apache-tvm-ffi==0.1.15.post2 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2
cbor2==6.3.0 compressed-tensors==0.17.0 depyf==0.20.0 dill==0.4.1 diskcache==5.6.3
docstring-parser==0.18.0 fastapi==0.136.3 googleapis-common-protos==1.76.0 httpcore2==2.16.2
httpx2==2.16.2 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0
jsonschema-specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3
loguru==0.7.3 mcp==2.3.0 mcp-types==2.3.0 megatron-core==0.19.2 mistral-common==1.13.1
model-hosting-container-standards==0.1.16 msgspec==0.22.0 openai==3.57.0 openai-harmony==0.0.8
opentelemetry-api==1.45.2 opentelemetry-exporter-http-transport==0.66b2
opentelemetry-exporter-otlp==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-proto==1.45.2
opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
opentelemetry-semantic-conventions-ai==0.5.1 partial-json-parser==0.2.1.1.post7
prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pydantic==2.14.4 pydantic-core==2.50.5
pydantic-extra-types==2.11.1 pyjwt==2.15.1 pytest-asyncio==1.5.0 python-json-logger==4.2.0
python-multipart==0.0.34 pyzmq==27.3.0 ray==2.60.0 referencing==0.37.0 rpds-py==2026.9.1
setproctitle==1.3.8 sniffio==1.3.1 sse-starlette==3.7.0 starlette==1.10.0 supervisor==4.3.0
tenacity==9.2.1 truststore==0.10.5 typing-inspection==0.4.5 uvicorn==0.54.0 vllm==0.24.0
watchfiles==1.3.0 xgrammar==0.2.8
""".split()

#: on the GPU machine's image already (benchmarks/gpu/README.md; the workplace's list of it)
DEVICE_HAS = set(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp
""".split()
)

#: vLLM's kernel packages for paths the tests do not take: each import of them in vLLM is
#: guarded (flashinfer: the sampler falls back to torch; the others serve MLA, MoE, FP8/FP4
#: GEMMs and fastsafetensors loading, none of them a dense bf16 Qwen2/Llama on one GPU).
#: Together they are several GB.
OPTIONAL = {
    "flashinfer-python",
    "flashinfer-cubin",
    "tilelang",
    "nvidia-cudnn-frontend",
    "fastsafetensors",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
    # the Anthropic SDK (19 MB): a requirement of vLLM's that no module of it imports (2 MiB as xz)
    "anthropic",
    # the outlines grammar engine (1.5 MiB as xz): imported only when a request asks for it.
    # (llguidance stays: vllm/v1/structured_output/__init__.py imports backend_guidance, whose
    # dataclass annotates a field with llguidance.LLMatcher, which loads it at import: without
    # it AsyncLLM did not import on the H200, 2026-11-28)
    "outlines-core",
}

#: paths (relative to site-packages) removed after unpacking; each says why it is safe
DROP = [
    # --- vLLM ---
    # flash-attention 2 (190 MB): FA3 is what vllm.vllm_flash_attn loads on sm_90; it tries
    # FA2 in a try/except and only raises when neither loads
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    # the fused-MoE kernels (45 MB): imported under try/except, used by MoE models only
    "vllm/_moe_C_stable_libtorch.abi3.so",
    # the Rust router/front end binary (37 MB): `vllm serve`'s, not AsyncLLM's
    "vllm/vllm-rs",
    # flashmla and qutlass: MLA attention (DeepSeek) and FP4 GEMMs, guarded imports
    "vllm/_flashmla_C.abi3.so",
    "vllm/_flashmla_extension_C.abi3.so",
    "vllm/_qutlass_C.abi3.so",
    # DeepGEMM (FP8) and the Blackwell FMHA with their CUTLASS headers: guarded by
    # has_deep_gemm() / sm_100 checks
    "vllm/third_party/deep_gemm",
    "vllm/third_party/fmha_sm100",
    # the API server's Swagger UI assets
    "vllm/entrypoints/serve/instrumentator/static",
    # --- tvm_ffi (xgrammar's, which vLLM's structured-output import loads: needed) ---
    # its C++ sources, headers and vendored libbacktrace: for building extensions, not loading
    # it (its testing library stays: core links it)
    "tvm_ffi/3rdparty",
    "tvm_ffi/include",
    "tvm_ffi/src",
    # --- Ray ---
    # the Java workers' jars (35 MB): no Java actors
    "ray/jars",
    # the dashboard's web client: include_dashboard=False; the dashboard agent's Python stays
    "ray/dashboard/client",
    # Ray's libraries: the job only uses ray core (init, remote, get, kill, shutdown,
    # is_initialized, cluster_resources, ray.exceptions); `import ray` imports none of these
    "ray/rllib",
    "ray/data",
    "ray/serve",
    "ray/train",
    "ray/tune",
    "ray/llm",
    "ray/air",
    "ray/workflow",
    # mistral-common's tokenizer files (36 MB): read when a Mistral tokenizer is made, never
    # for the Qwen2 and Llama checkpoints of the tests
    "mistral_common/data",
    # megatron's training scripts (megatron/training): rl-fabric uses megatron.core only
    "megatron/training",
]

#: files matching these are removed anywhere in the tree: bytecode is rebuilt on the device,
#: RECORD lists hashes of files we changed or removed (only `pip uninstall` reads it)
DROP_PATTERNS = [r"(^|/)__pycache__(/|$)", r"\.pyc$", r"\.dist-info/RECORD$"]

FATBIN_MAGIC = 0xBA55ED50
#: the architecture whose CUDA code is kept: H100 and H200 are sm_90 (sm_90a shares the number)
KEEP_ARCH = 90
#: zeroed PTX entries are relabelled to an architecture above any the device has, so that
#: the driver, which JIT-compiles the newest PTX not above the device's, never picks one
DEAD_ARCH = 0xFFFF


def run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> str:
    return canon(path.name.split("-")[0])


def download(spec: str, dest: Path) -> Path:
    """The wheel of ``spec`` for the device's Python and platform (pip's cache makes a
    rerun cheap)."""
    name = canon(re.split(r"[<>=!~; ]", spec, maxsplit=1)[0])
    found = [p for p in dest.glob("*.whl") if wheel_name(p) == name]
    if not found:
        plats = [a for p in PLATFORMS for a in ("--platform", p)]
        run(
            sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", PY, "--implementation", "cp", *plats, "-d", str(dest), spec,
            env={**os.environ, "PIP_CONSTRAINT": ""},  # this machine's torch cap is not the device's
        )  # fmt: skip
        found = [p for p in dest.glob("*.whl") if wheel_name(p) == name]
    if len(found) != 1:
        raise SystemExit(f"pack_offline: expected one wheel for {spec}, found {found}")
    return found[0]


def requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional ``Requires-Dist`` on the device (extras skipped)."""
    from packaging.requirements import Requirement

    env = {
        "python_version": PY,
        "python_full_version": "3.12.3",
        "platform_machine": "x86_64",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(str(req.name) + str(req.specifier))
    return out


def resolve(dest: Path) -> list[str]:
    """The closure of ROOTS as PyPI has it now: the newest release of each name that meets
    the first requirement on it met (later requirements are checked, a conflict printed)."""
    from packaging.requirements import Requirement

    todo, chosen = list(ROOTS), dict[str, str]()
    while todo:
        req = Requirement(todo.pop(0))
        name = canon(req.name)
        if name in DEVICE_HAS or name in OPTIONAL:
            continue
        if name in chosen:
            if not req.specifier.contains(chosen[name], prereleases=True):
                print(f"conflict: {req} but {name}=={chosen[name]}", file=sys.stderr)
            continue
        wheel = download(f"{req.name}{req.specifier}", dest)
        chosen[name] = wheel.name.split("-")[1]
        todo += requirements(wheel)
    return [f"{n}=={v}" for n, v in sorted(chosen.items())]


def elf_section(path: Path, name: str) -> tuple[int, int] | None:
    """(file offset, size) of the ELF section ``name``, read off ``readelf -SW``."""
    out = run("readelf", "-SW", str(path), capture_output=True, text=True).stdout
    for line in out.splitlines():
        cols = line.split("]", 1)[-1].split()
        if len(cols) > 5 and cols[0] == name:
            return int(cols[3], 16), int(cols[4], 16)
    return None


def zero_fatbins(path: Path) -> tuple[int, int]:
    """Zeroes, in place, the CUDA code in ``path``'s ``.nv_fatbin`` that an sm_90 GPU never
    loads; returns (bytes zeroed, bytes kept).

    The section is a run of fat binaries (16-byte header: magic, version, header size,
    size of what follows), each a run of entries (kind 1 = PTX, 2 = cubin; the architecture
    at +28; the payload's size at +8, after the entry's header). A fat binary is one kernel
    file's code for every architecture it was built for; the driver loads the cubin of the
    device's architecture, else JIT-compiles the newest PTX not above it. So per fat binary:
    keep the sm_90 cubins; when there is none, keep the newest PTX not above sm_90 (the
    driver would JIT it, as it does now); zero every other payload. Headers and sizes stay,
    so every offset the host code holds (``.nvFatBinSegment`` points into this section) is
    still valid, and a zeroed PTX entry that the driver could otherwise choose is relabelled
    to DEAD_ARCH so it is never JIT-compiled. A kernel left without sm_90 code or PTX (one
    built only for other GPUs) fails as before: "no kernel image is available"."""
    sec = elf_section(path, ".nv_fatbin")
    if sec is None:
        return 0, 0
    start, size = sec
    data = bytearray(path.read_bytes())
    pos, end, zeroed, kept = start, start + size, 0, 0
    while pos + 16 <= end:
        magic, _version, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # fat binaries are 8-byte aligned, padded between
            continue
        entries, q, stop = [], pos + hsize, pos + hsize + fsize
        while q < stop:
            kind, _, ehsize, psize = struct.unpack_from("<HHIQ", data, q)
            (arch,) = struct.unpack_from("<I", data, q + 28)
            entries.append((q, kind, ehsize, psize, arch))
            q += ehsize + psize
        if q != stop:
            raise SystemExit(f"pack_offline: {path}: a fat binary at {pos:#x} does not parse")
        has_cubin = any(k == 2 and a == KEEP_ARCH for _, k, _, _, a in entries)
        ptx = [a for _, k, _, _, a in entries if k == 1 and a <= KEEP_ARCH]
        jit_arch = None if has_cubin or not ptx else max(ptx)
        for q, kind, ehsize, psize, arch in entries:
            if (kind == 2 and arch == KEEP_ARCH) or (kind == 1 and arch == jit_arch):
                kept += psize
                continue
            data[q + ehsize : q + ehsize + psize] = bytes(psize)
            zeroed += psize
            if kind == 1 and arch <= KEEP_ARCH:
                struct.pack_into("<I", data, q + 28, DEAD_ARCH)
        pos = stop
    path.write_bytes(data)
    return zeroed, kept


def is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def build(work: Path) -> Path:
    wheels, site = work / "wheels", work / "site"
    wheels.mkdir(parents=True, exist_ok=True)
    if site.exists():
        shutil.rmtree(site)
    site.mkdir()
    for spec in PINS:
        with zipfile.ZipFile(download(spec, wheels)) as z:
            z.extractall(site)
            # zipfile drops the mode bits: Ray starts gcs_server and raylet as programs
            for info in z.infolist():
                if (info.external_attr >> 16) & 0o111:
                    (site / info.filename).chmod(0o755)
    # Ray's own CLI scripts etc. land in <name>.data/: nothing there is imported
    for data_dir in site.glob("*.data"):
        shutil.rmtree(data_dir)
    for rel in DROP:
        p = site / rel
        if not p.exists():
            raise SystemExit(f"pack_offline: {rel} is not in the wheels any more: check the trims")
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    drop = re.compile("|".join(DROP_PATTERNS))
    for p in sorted(site.rglob("*"), reverse=True):
        if drop.search(p.relative_to(site).as_posix()) and p.exists():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for p in sorted(site.rglob("*")):
        if p.is_file() and not p.is_symlink() and is_elf(p):
            zeroed, kept = zero_fatbins(p)
            if zeroed:
                mib = f"zeroed {zeroed / 2**20:.1f} MiB of CUDA code, kept {kept / 2**20:.1f}"
                print(f"{p.relative_to(site)}: {mib}")
            # symbols for debuggers and the static linker: a loaded library needs only the
            # dynamic ones, which --strip-unneeded keeps
            run("strip", "--strip-unneeded", str(p))
    return site


def write_tar(site: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    # sorted names, fixed owners and times: the same wheels give the same archive
    run(
        "tar", "--sort=name", "--owner=0", "--group=0", "--numeric-owner", "--mtime=2026-01-01",
        "-I", "xz -9e -T0", "-cf", str(tmp), "-C", str(site), ".",
    )  # fmt: skip
    tmp.replace(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu" / "pack.tar.xz")
    ap.add_argument("--work", type=Path, default=Path("/tmp/rl-fabric-pack"), help="wheels and the tree")
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    ap.add_argument("--resolve", action="store_true", help="print the closure as PyPI has it now; no pack")
    args = ap.parse_args()
    if args.resolve:
        (args.work / "resolve").mkdir(parents=True, exist_ok=True)
        print(" ".join(resolve(args.work / "resolve")))
        return
    site = build(args.work)
    write_tar(site, args.out)
    mib = args.out.stat().st_size / 2**20
    print(f"{args.out}: {mib:.1f} MiB ({len(PINS)} distributions; limit {args.limit_mib} MiB)")
    if mib > args.limit_mib:
        args.out.unlink()
        raise SystemExit(f"pack_offline: the pack is {mib:.1f} MiB, over the {args.limit_mib} MiB limit")


if __name__ == "__main__":
    main()
