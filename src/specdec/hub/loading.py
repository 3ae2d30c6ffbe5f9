"""Loading models and tokenizers from a local path or a Hugging Face hub id."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from specdec.errors import ConfigError, ModelLoadError

_DTYPES = {"auto": "auto", "float32": torch.float32, "float64": torch.float64,
           "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype | str:
    """None: float32 on CPU (16-bit matmuls are slow there), the checkpoint's own dtype elsewhere."""
    if dtype is None:
        return torch.float32 if str(device).startswith("cpu") else "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}") from None


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


def resolve_name(path: str | Path) -> str | Path:
    """A shipped model's name ("default-seq2seq": the seq2seq pair's target) as its directory; else `path`."""
    from specdec.hub.default_pair import DEFAULT_SEQ2SEQ, SEQ2SEQ_DIR

    return SEQ2SEQ_DIR / "target" if str(path) == DEFAULT_SEQ2SEQ else path


def _model_class(path: str | Path):
    """AutoModelForCausalLM; for an encoder-decoder checkpoint AutoModelForSeq2SeqLM (text) or
    AutoModelForSpeechSeq2Seq (speech: Whisper), read from its config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError):
        return AutoModelForCausalLM  # the load below reports the problem
    if not getattr(config, "is_encoder_decoder", False):
        return AutoModelForCausalLM
    speech = type(config) in AutoModelForSpeechSeq2Seq._model_mapping
    return AutoModelForSpeechSeq2Seq if speech else AutoModelForSeq2SeqLM


def is_speech_checkpoint(path: str | Path) -> bool:
    from transformers import AutoModelForSpeechSeq2Seq

    return _model_class(path) is AutoModelForSpeechSeq2Seq


def load_model(path: str | Path, device: str = "cpu", dtype: str | torch.dtype | None = None):
    """AutoModelForCausalLM.from_pretrained(path) (AutoModelForSeq2SeqLM / AutoModelForSpeechSeq2Seq for an
    encoder-decoder checkpoint), in eval mode on `device`."""
    check_device(device)
    path = resolve_name(path)
    try:
        with _no_progress_bars():
            model = _model_class(path).from_pretrained(str(path), dtype=resolve_dtype(dtype, device))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load a causal LM from {str(path)!r}: it is not a local directory with a config.json "
            f"and weights, nor a reachable hub id ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "check the path, or download the model first when offline"
        ) from exc
    return model.to(device).eval()


def load_tokenizer(path: str | Path):
    """AutoTokenizer; for a speech encoder-decoder (Whisper) the AutoProcessor: its feature extractor makes
    the encoder's input_features, its tokenizer decodes the output."""
    from transformers import AutoProcessor, AutoTokenizer

    path = resolve_name(path)
    try:
        if is_speech_checkpoint(path):
            return AutoProcessor.from_pretrained(str(path))
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {str(path)!r} ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            "point at a directory with tokenizer files, or pass token ids instead of text"
        ) from exc


def load(path: str | Path, device: str = "cpu", dtype: str | torch.dtype | None = None):
    """(model, tokenizer) from a local path or hub id: AutoModelForCausalLM + AutoTokenizer. Encoder-decoder
    checkpoints: AutoModelForSeq2SeqLM + AutoTokenizer, or AutoModelForSpeechSeq2Seq + AutoProcessor.
    "default-seq2seq" names the shipped seq2seq target (its draft: specdec.load_default_seq2seq())."""
    return load_model(path, device, dtype), load_tokenizer(path)
