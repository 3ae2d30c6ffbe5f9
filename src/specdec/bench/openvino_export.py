"""The OpenVINO peer's models: optimum-intel exports of a checkpoint directory, cached by content hash.

    ir_dir = exported(Path("assets/default/target"), cache_dir=default_cache_dir(), export_env=default_export_env())

A checkpoint is exported once per weight format: its files (config, weights, tokenizer) are hashed together with
the export recipe (`recipe`: tool versions, task, the format's flags), and the IR lands in
`<cache_dir>/<hash>-<format>`; a later run with the same files finds it there and exports nothing. The formats
(`WEIGHT_FORMATS`):

- `fp32` (the bench's): float32 weights; the compute precision is the runtime's `INFERENCE_PRECISION_HINT`, set
  from the bench's `--dtype` (`specdec.bench.openvino_peer`), and the CPU plugin converts the weights to it;
- `int8` and `int4`: OpenVINO's weight-only compression (NNCF, through optimum-cli) at the bits of specdec's own
  formats of the same names (docs/quantization.md): int8 symmetric per output channel; int4 symmetric in groups
  of 64 on every layer (`--ratio 1.0`), NNCF keeping the embeddings and LM head in int8.

The export runs `optimum-cli` in a separate virtual environment, the *export environment*, because
optimum-intel 2.2.0 caps transformers < 5.6 while specdec runs on transformers 5.24. `create_export_env` (the
CLI's `specdec bench --openvino-setup`) builds it with every package pinned
(`openvino-export-constraints.txt` beside this module). Only the export needs it; running an exported IR
needs `pip install "specdec[openvino]"` in specdec's own environment.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError
from specdec.runtime.precision import cache_file

log = logging.getLogger("specdec.openvino")

#: The pinned packages of the export environment (the whole resolved set, optimum-intel included).
CONSTRAINTS = Path(__file__).resolve().parent / "openvino-export-constraints.txt"
#: optimum-intel's own dependencies, less torchvision (not used for a text model; it drags in a CUDA torch).
EXPORT_PACKAGES = ("torch", "transformers", "optimum", "nncf", "openvino", "openvino-tokenizers",
                   "huggingface_hub", "requests", "setuptools")
#: Installed last, without its dependencies (all of them but torchvision are in EXPORT_PACKAGES).
OPTIMUM_INTEL = "optimum-intel"
TASK = "text-generation-with-past"
#: Weight format -> optimum-cli's flags for it.
WEIGHT_FORMATS = {
    "fp32": ("--weight-format", "fp32"),
    "int8": ("--weight-format", "int8", "--sym"),
    "int4": ("--weight-format", "int4", "--sym", "--group-size", "64", "--ratio", "1.0"),
}
TOOLS = "optimum-intel 2.2.0, transformers 5.5.4, openvino 2026.4.1"
#: Written last into a finished export environment / a finished export.
ENV_MARKER = "specdec-openvino-export-env.json"
EXPORT_MARKER = "specdec-openvino-export.json"
#: Files of a checkpoint directory left out of its hash (documentation, not model).
_NOT_MODEL = (".md",)


class OpenVINOExportError(SpecdecError, RuntimeError):
    """No OpenVINO IR for a checkpoint and no way to make one (export environment missing or export failed)."""


def recipe(weights: str = "fp32") -> str:
    """What an export of `weights` is made with: part of its cache key, so a change of the recipe, of the format's
    flags or of the pinned tools exports again."""
    if weights not in WEIGHT_FORMATS:
        raise OpenVINOExportError(f"no OpenVINO export format {weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    return f"{TOOLS}; {TASK}; {' '.join(WEIGHT_FORMATS[weights])}"


def default_cache_dir() -> Path:
    """`$SPECDEC_OPENVINO_CACHE`, else `$XDG_CACHE_HOME/specdec/openvino` (`~/.cache/specdec/openvino`)."""
    if os.environ.get("SPECDEC_OPENVINO_CACHE"):
        return Path(os.environ["SPECDEC_OPENVINO_CACHE"]).expanduser()
    return cache_file("openvino")


def default_export_env() -> Path:
    """`$SPECDEC_OPENVINO_EXPORT_ENV`, else `export-env` in the default cache directory."""
    if os.environ.get("SPECDEC_OPENVINO_EXPORT_ENV"):
        return Path(os.environ["SPECDEC_OPENVINO_EXPORT_ENV"]).expanduser()
    return default_cache_dir() / "export-env"


def content_hash(model_dir: str | Path, weights: str = "fp32") -> str:
    """sha256 (hex, 16 digits) of every file under `model_dir` (names and bytes, in sorted order; *.md left
    out) and of the `recipe` for `weights`."""
    root = Path(model_dir)
    if not (root / "config.json").is_file():
        raise OpenVINOExportError(f"{root} is not a checkpoint directory (no config.json): the OpenVINO peer "
                                  "exports a local Hugging Face checkpoint; pass its directory")
    digest = hashlib.sha256(recipe(weights).encode())
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(_NOT_MODEL))
    for path in files:
        digest.update(b"\0" + str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Export:
    """One cached export: where the IR is, what it was made from, and whether this call made it."""

    path: Path
    source: Path
    hash: str
    exported_now: bool
    seconds: float  # the export's time (0 on a cache hit)
    weights: str = "fp32"  # WEIGHT_FORMATS

    def as_dict(self) -> dict:
        return {"path": str(self.path), "source": str(self.source), "hash": self.hash, "weights": self.weights,
                "exported_now": self.exported_now, "export_s": self.seconds, "recipe": recipe(self.weights)}


def exported(model_dir: str | Path, cache_dir: str | Path | None = None,
             export_env: str | Path | None = None, weights: str = "fp32") -> Export:
    """The OpenVINO IR of `model_dir` with `weights` (WEIGHT_FORMATS): from the cache, or exported now with the
    export environment's optimum-cli into a temporary directory that becomes the cache entry only once complete."""
    source = Path(model_dir).resolve()
    key = content_hash(source, weights)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / f"{key}-{weights}"
    if (final / EXPORT_MARKER).is_file():
        return Export(final, source, key, False, 0.0, weights)
    cli = optimum_cli(Path(export_env) if export_env is not None else default_export_env())
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache))
    try:
        out = work / "ir"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["HF_HUB_OFFLINE"] = "1"  # a local directory: nothing to download
        command = [str(cli), "export", "openvino", "--model", str(source), "--task", TASK,
                   *WEIGHT_FORMATS[weights], str(out)]
        log.info("exporting %s to OpenVINO (once; cached as %s)", source, final)
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - start
        if done.returncode != 0 or not (out / "openvino_model.xml").is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            shutil.rmtree(work, ignore_errors=True)  # before the disk is measured
            raise OpenVINOExportError(f"exporting {source} to OpenVINO failed ({' '.join(command)}, exit "
                                      f"{done.returncode}):\n{tail}{_disk_hint(source, cache)}")
        (out / EXPORT_MARKER).write_text(json.dumps(
            {"source": str(source), "hash": key, "recipe": recipe(weights), "command": command, "export_s": seconds},
            indent=1) + "\n")
        try:
            os.replace(out, final)
        except OSError:  # another process finished the same export first: keep its copy
            if not (final / EXPORT_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Export(final, source, key, True, seconds, weights)


def _disk_hint(source: Path, cache: Path) -> str:
    """After a failed export: a sentence naming a full disk as the likely cause when the cache's disk has less free
    space than twice the checkpoint's size (optimum-cli writes the model uncompressed, about the checkpoint's size,
    before it compresses it, and float32 from a bfloat16 checkpoint is twice it; its error is then an unspecific
    I/O error, such as "basic_ios::clear: iostream error"); else nothing."""
    size = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    free = shutil.disk_usage(cache).free
    if free >= 2 * size:
        return ""
    return (f"\nThe disk holding {cache} has {free / 1e9:.1f} GB free, less than twice the checkpoint's "
            f"{size / 1e9:.1f} GB: optimum-cli writes the model uncompressed before it compresses it, so a full disk "
            "is the likely cause. Free space there, or pass --openvino-cache DIR (SPECDEC_OPENVINO_CACHE) on a "
            "larger disk.")


def optimum_cli(env_dir: Path) -> Path:
    """The export environment's `optimum-cli`, or an OpenVINOExportError saying how to create one."""
    cli = env_dir / "bin" / "optimum-cli"
    if not cli.is_file():
        raise OpenVINOExportError(
            f"no OpenVINO export environment at {env_dir}: create it once with `specdec bench --openvino-setup` "
            "(a separate virtual environment with optimum-intel 2.2.0, which needs transformers < 5.6), or pass "
            "--openvino-export-env DIR (or set SPECDEC_OPENVINO_EXPORT_ENV) for an environment that has "
            "optimum-cli with optimum-intel")
    return cli


def create_export_env(env_dir: str | Path | None = None, *, python: str = sys.executable,
                      quiet: bool = True) -> Path:
    """Create the export environment at `env_dir` (default `default_export_env()`): a virtual environment
    with the packages of `CONSTRAINTS`, optimum-intel installed without its dependencies. Does nothing if
    a finished one is there; removes what it made if a step fails."""
    env = Path(env_dir) if env_dir is not None else default_export_env()
    if (env / ENV_MARKER).is_file():
        return env
    if env.exists() and any(env.iterdir()):
        raise OpenVINOExportError(f"{env} exists and is not a finished OpenVINO export environment: remove it, "
                                  "or pass another --openvino-export-env DIR")
    env.parent.mkdir(parents=True, exist_ok=True)
    log.info("creating the OpenVINO export environment in %s (pinned by %s)", env, CONSTRAINTS.name)
    pip_flags = ["-q"] if quiet else []
    steps = [
        [python, "-m", "venv", str(env)],
        [str(env / "bin" / "python"), "-m", "pip", "install", *pip_flags, "-c", str(CONSTRAINTS), *EXPORT_PACKAGES],
        [str(env / "bin" / "python"), "-m", "pip", "install", *pip_flags, "--no-deps", "-c", str(CONSTRAINTS),
         OPTIMUM_INTEL],
        [str(env / "bin" / "optimum-cli"), "export", "openvino", "--help"],
    ]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
                raise OpenVINOExportError(f"creating the OpenVINO export environment failed at "
                                          f"`{' '.join(step)}` (exit {done.returncode}):\n{tail}")
        freeze = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True,
                                text=True, check=True).stdout.split()
        (env / ENV_MARKER).write_text(json.dumps({"constraints": str(CONSTRAINTS), "packages": freeze}, indent=1)
                                      + "\n")
    except BaseException:
        shutil.rmtree(env, ignore_errors=True)
        raise
    return env
