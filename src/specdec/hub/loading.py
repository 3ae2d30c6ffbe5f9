"""Loading models and tokenizers from a local path or a Hugging Face hub id."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from specdec.errors import ConfigError, ModelLoadError

#: transformers' spelling of "the checkpoint's own dtype" (what `dtype="checkpoint"` passes to from_pretrained).
CHECKPOINT_DTYPE = "auto"
_DTYPES = {"checkpoint": CHECKPOINT_DTYPE, "float32": torch.float32, "float64": torch.float64,
           "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype | str:
    """None: float32 on CPU, the checkpoint's own dtype elsewhere ("checkpoint"). "auto": bfloat16 where the
    device computes it natively (a CPU: measured once, runtime/precision.py), float32 elsewhere."""
    if dtype is None:
        return torch.float32 if str(device).startswith("cpu") else CHECKPOINT_DTYPE
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        from specdec.runtime.precision import auto_dtype  # noqa: PLC0415 (measures on first use)

        return auto_dtype(device)
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}") from None


def check_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, or a ConfigError when torch does not know it or cannot use it here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {str(device)!r}; use cpu, cuda, cuda:0 or mps (--device cpu)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {str(device)!r} is not available: this torch ({torch.__version__}) has no CUDA support or "
            "sees no GPU; use cpu (--device cpu), or install a CUDA build of torch"
        )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {str(device)!r} is not available on this machine; use cpu (--device cpu)")
    return dev


@contextmanager
def _no_progress_bars():
    """Silence transformers' per-load progress bars, restoring the caller's setting afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def resolve_name(path: str | Path, part: str = "target") -> str | Path:
    """A shipped model's name ("default-seq2seq": the seq2seq pair) as the directory of its `part` ("target", or
    "tokenizer": the pair's one tokenizer); else `path`."""
    from specdec.hub.default_pair import DEFAULT_SEQ2SEQ, SEQ2SEQ_DIR

    return SEQ2SEQ_DIR / part if str(path) == DEFAULT_SEQ2SEQ else path


#: Seconds to wait for a TCP connection to the hub before loading from the local cache only.
HUB_PROBE_TIMEOUT_S = 3.0
_hub_unreachable_by_endpoint: dict[str, str | None] = {}  # endpoint -> why it cannot be reached (None: it can)


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached now (offline mode, or no connection to it within
    HUB_PROBE_TIMEOUT_S), or None. Probed once per process and endpoint; through a proxy nothing is probed."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE)"
    if urllib.request.getproxies():  # the hub client knows how to go through it; a direct probe does not
        return None
    endpoint = constants.ENDPOINT
    if endpoint not in _hub_unreachable_by_endpoint:
        url = urlsplit(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname, port), timeout=HUB_PROBE_TIMEOUT_S).close()
            why = None
        except OSError as exc:
            why = f"no connection to {url.hostname}: {exc.strerror or exc}"
        _hub_unreachable_by_endpoint[endpoint] = why
    return _hub_unreachable_by_endpoint[endpoint]


def cache_only(path: str | Path) -> bool:
    """True when `path` is a hub id to load from the local cache only, the hub being unreachable; raises a
    ModelLoadError at once when it is not cached either (instead of the hub client's retries). False for a
    local path, or when the hub can be reached."""
    if Path(path).exists():
        return False
    why = hub_unreachable()
    if why is None:
        return False
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(str(path), "config.json")
    except ValueError:  # not even a valid hub id
        cached = None
    if isinstance(cached, str):
        return True
    raise ModelLoadError(
        f"cannot load {str(path)!r}: it is not a local directory, and the Hugging Face hub cannot be reached "
        f"({why}) while it is not in the local hub cache either; check the path, or download it first where "
        f"there is network (`hf download {path}`)"
    )


def auto_class_of(config):
    """The transformers auto class a model of `config` loads through: AutoModelForCausalLM; for an encoder-decoder
    AutoModelForSeq2SeqLM (text) or AutoModelForSpeechSeq2Seq (speech: Whisper)."""
    from transformers import (
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING,
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSpeechSeq2Seq,
    )

    if not config.is_encoder_decoder:
        return AutoModelForCausalLM
    speech = type(config) in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING
    return AutoModelForSpeechSeq2Seq if speech else AutoModelForSeq2SeqLM


def model_class(path: str | Path, cache: bool = False):
    """`auto_class_of` the checkpoint's config (AutoModelForCausalLM when it has none: the load reports that)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=cache)
    except (OSError, ValueError):
        return AutoModelForCausalLM  # the load below reports the problem
    return auto_class_of(config)


def is_speech_checkpoint(path: str | Path, cache: bool = False) -> bool:
    from transformers import AutoModelForSpeechSeq2Seq

    return model_class(path, cache) is AutoModelForSpeechSeq2Seq


def load_model(path: str | Path, device: str = "cpu", dtype: str | torch.dtype | None = None,
               weights: str | None = None):
    """AutoModelForCausalLM.from_pretrained(path) (AutoModelForSeq2SeqLM / AutoModelForSpeechSeq2Seq for an
    encoder-decoder checkpoint), in eval mode on `device`; `weights` "float32" | "bfloat16" | "int8" | "int4": its
    linear layers on packed weights of that format (runtime/weights.py), on the CPU."""
    from specdec.runtime.weights import check_format, pack_model  # noqa: PLC0415

    check_device(device)
    if check_format(weights) is not None and not str(device).startswith("cpu"):
        raise ConfigError(f"weights={weights!r} runs on specdec's CPU kernels only; use device='cpu' (--device cpu), "
                          "or leave weights out")
    path = resolve_name(path)
    cache = cache_only(path)
    if check_format(weights) is not None:  # a safetensors checkpoint: packed as it is read (hub/streamed.py)
        from specdec.hub.streamed import load_streamed, local_checkpoint  # noqa: PLC0415

        with _no_progress_bars():
            local = local_checkpoint(path, cache)
            model = None if local is None else load_streamed(local, resolve_dtype(dtype, device), weights)
        if model is not None:
            return model
    try:
        with _no_progress_bars():
            model = model_class(path, cache).from_pretrained(str(path), dtype=resolve_dtype(dtype, device),
                                                              local_files_only=cache)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load a causal LM from {str(path)!r}: it is not a local directory with a config.json "
            f"and weights, nor a reachable hub id ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "check the path, or download the model first when offline"
        ) from exc
    return pack_model(model.to(device).eval(), weights) if weights else model.to(device).eval()


def load_tokenizer(path: str | Path):
    """AutoTokenizer; for a speech encoder-decoder (Whisper) the AutoProcessor: its feature extractor makes
    the encoder's input_features, its tokenizer decodes the output."""
    from transformers import AutoProcessor, AutoTokenizer

    path = resolve_name(path, "tokenizer")
    cache = cache_only(path)
    try:
        if is_speech_checkpoint(path, cache):
            return AutoProcessor.from_pretrained(str(path), local_files_only=cache)
        return AutoTokenizer.from_pretrained(str(path), local_files_only=cache)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {str(path)!r} ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "point at a directory with tokenizer files, or pass token ids instead of text"
        ) from exc


def load(path: str | Path, device: str = "cpu", dtype: str | torch.dtype | None = None, weights: str | None = None):
    """(model, tokenizer) from a local path or hub id: AutoModelForCausalLM + AutoTokenizer. Encoder-decoder
    checkpoints: AutoModelForSeq2SeqLM + AutoTokenizer, or AutoModelForSpeechSeq2Seq + AutoProcessor.
    "default-seq2seq" names the shipped seq2seq target (its draft: specdec.load_default_seq2seq()).
    weights="float32" | "bfloat16" | "int8" | "int4": the linear layers' weights in that format, packed for specdec's
    CPU kernels (int8 / int4: weight-only quantization; docs/quantization.md)."""
    return load_model(path, device, dtype, weights), load_tokenizer(path)
