"""Writing heads in the layouts vLLM and SGLang load, and reading those layouts back.

Formats (key names and configs follow the engines' loaders; see docs/heads.md for the files read):

* ``vllm-eagle``   vLLM `vllm/model_executor/models/llama_eagle.py` (EagleLlamaForCausalLM): a Llama
  config with ``architectures: ["LlamaForCausalLM"]`` (vLLM prefixes "Eagle"), one layer, ``bias: false``;
  keys ``fc.weight`` [H, 2H], ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``; no layer-0
  input norm, no LM head and no embedding (both shared with the target).
* ``sglang-eagle`` SGLang `python/sglang/srt/models/llama_eagle.py` (LlamaForCausalLMEagle): the same keys
  plus ``fc.bias`` (SGLang's fc always has one; zeros for a bias-free head).
* ``vllm-medusa``  vLLM `vllm/model_executor/models/medusa.py` + `vllm/transformers_utils/configs/medusa.py`:
  ``model_type: "medusa"``, ``medusa_num_heads``, ``medusa_num_layers``, ``medusa_fc_bias: true``; keys
  ``blocks.{h}.layers.{l}.weight/.bias`` and ``lm_heads.{h}.weight`` (the target's LM head, copied: specdec
  shares it, vLLM wants one per head).
* ``eagle3``       EAGLE-3, vLLM `vllm/model_executor/models/llama_eagle3.py` (Eagle3LlamaForCausalLM) and
  SGLang `python/sglang/srt/models/llama_eagle3.py` (LlamaForCausalLMEagle3), the layout NVIDIA
  Model-Optimizer's `hf_spec_export.py` writes: ``architectures: ["LlamaForCausalLMEagle3"]``, one layer,
  ``draft_vocab_size``, ``target_hidden_size``, ``eagle_config`` with ``use_aux_hidden_state`` and the
  feature layers (``eagle_aux_hidden_state_layer_ids``, HF hidden-state indices = input of that layer, the
  convention vLLM reads as-is; written only when they are not the engines' default (2, N//2, N-3));
  keys ``midlayer.self_attn.{q,k,v}_proj.weight`` [·, 2H], ``midlayer.self_attn.o_proj.weight``,
  ``midlayer.mlp.{gate,up,down}_proj.weight``, ``midlayer.{input_layernorm,hidden_norm,
  post_attention_layernorm}.weight``, ``fc.weight`` [H, 3H] (no bias), ``norm.weight``, ``lm_head.weight``
  [draft vocab, H] (the target's rows when the head shares its LM head); with a reduced draft vocabulary
  only, ``d2t`` [draft vocab] int64 (target id = i + d2t[i]) and ``t2d`` [V] bool (ignored by both
  loaders, kept for EAGLE's own code). vLLM 0.32 creates the d2t parameter only when ``draft_vocab_size``
  differs from the target's vocabulary and refuses a file that has one otherwise.
  Only EAGLE-3 heads (`variant="eagle3"`) with three feature layers below the target's layer count can be
  written this way, and an EAGLE-3 head cannot be written as ``vllm-eagle`` / ``sglang-eagle``.

Every export is written to a temporary directory and renamed into place.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from specdec.errors import ConfigError, ModelLoadError
from specdec.heads.common import check_target, replace_dir
from specdec.heads.eagle import EagleHead
from specdec.heads.medusa import MedusaHeads

FORMATS = ("vllm-eagle", "sglang-eagle", "eagle3", "vllm-medusa")
#: Families whose single decoder layer is a Llama layer key for key (what the engines' EAGLE loaders build).
LLAMA_LAYOUT = ("llama",)
EAGLE_ARCHITECTURES = {"vllm-eagle": "LlamaForCausalLM", "sglang-eagle": "LlamaForCausalLMEagle"}


def _llama_config(head: EagleHead, dtype: torch.dtype) -> dict[str, Any]:
    """The head's one-layer body config as the engines' Llama loaders read it."""
    config = dict(head.body_config.to_dict())
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "id2label", "label2id",
                "auto_map", "layer_types"):
        config.pop(key, None)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config.update({"model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False,
                   "torch_dtype": str(dtype).removeprefix("torch.")})
    return config


def _check_llama(head: EagleHead, fmt: str) -> None:
    model_type = head.signature["model_type"]
    if model_type not in LLAMA_LAYOUT:
        raise ConfigError(
            f"--format {fmt} writes a Llama decoder layer, but this head's layer is {model_type!r} (its target's "
            "family); the engines' EAGLE loaders cannot express it: serve it with specdec, or train a head for a "
            "Llama-family target"
        )


def _eagle_files(head: EagleHead, fmt: str, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    _check_llama(head, fmt)
    if head.variant != "eagle":
        raise ConfigError(f"--format {fmt} writes an EAGLE-1/2 head (fc over [embedding, last feature]); this is an "
                          "EAGLE-3 head (fused features, 2H-input midlayer, own norm): export --format eagle3")
    if fmt == "vllm-eagle" and head.fc.bias is not None:
        raise ConfigError("--format vllm-eagle needs a bias-free fc (vLLM builds fc with bias=False) but this head "
                          "has an fc bias; export --format sglang-eagle, or train with the default (no bias)")
    config = _llama_config(head, dtype)
    config.update({"architectures": [EAGLE_ARCHITECTURES[fmt]], "bias": fmt == "sglang-eagle"})
    tensors = {"fc.weight": head.fc.weight}
    if fmt == "sglang-eagle":
        tensors["fc.bias"] = head.fc.bias if head.fc.bias is not None else torch.zeros(head.fc.out_features)
    for name, value in head.body.state_dict().items():
        tensors[name] = value  # layers.0.* (no input_layernorm: the head has none)
    return config, tensors


def engine_default_layers(num_layers: int) -> tuple[int, int, int]:
    """The feature layers vLLM and SGLang capture when a config names none: EAGLE-3's (2, N//2, N-3)."""
    return 2, num_layers // 2, num_layers - 3


def _eagle3_files(head: EagleHead, target: PreTrainedModel | None,
                  dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    _check_llama(head, "eagle3")
    if head.variant != "eagle3":
        raise ConfigError(
            "--format eagle3 needs an EAGLE-3 head (fc over three fused target layers, a 2H-input midlayer, its own "
            "norm and LM head); this is an EAGLE-1/2 head: export --format vllm-eagle or sglang-eagle, or train one "
            "with `specdec train-head --kind eagle3`")
    num_layers = head.signature["num_hidden_layers"]
    layers = head.feature_layers
    if len(layers) != 3 or max(layers) >= num_layers:
        raise ConfigError(
            f"--format eagle3 captures three features, each the input of a target layer (ids 0..{num_layers - 1}); "
            f"this head reads hidden states {list(layers)}: train one with --feature-layers of three ids below "
            f"{num_layers}")
    if head.fc.bias is not None:
        raise ConfigError("--format eagle3 needs a bias-free fc (vLLM builds it with bias=False); train without one")
    if head.lm_head is None and target is None:
        raise ConfigError("this EAGLE-3 head shares the target's LM head, which the eagle3 layout stores as "
                          "lm_head.weight: pass the target")
    hidden, vocab = head.hidden_size, head.signature["vocab_size"]
    config = _llama_config(head, dtype)
    config.update({"architectures": ["LlamaForCausalLMEagle3"], "bias": False, "target_hidden_size": hidden,
                   "norm_before_residual": False,
                   "draft_vocab_size": head.draft_vocab_size or vocab,
                   "eagle_config": {"use_aux_hidden_state": True}})
    if tuple(layers) != engine_default_layers(num_layers):
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(layers)
    tensors = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight}
    for name, value in head.body.layers[0].state_dict().items():
        tensors[f"midlayer.{name}"] = value
    if head.lm_head is None:  # shared: the target's rows, the whole vocabulary in order (no d2t / t2d)
        tensors["lm_head.weight"] = target.get_output_embeddings().weight
        return config, tensors
    # A reduced draft vocabulary: vLLM creates draft_id_to_target_id (filled from d2t) only when
    # draft_vocab_size differs from the target's vocabulary, and refuses a d2t it has no parameter for.
    tensors["lm_head.weight"] = head.lm_head.weight
    draft_to_target = head.draft_to_target.cpu()
    tensors["d2t"] = draft_to_target - torch.arange(draft_to_target.shape[0])  # [Vd] target = i + d2t[i]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_to_target] = True
    tensors["t2d"] = t2d  # [V]
    return config, tensors


def _medusa_files(heads: MedusaHeads, target: PreTrainedModel) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    sig = heads.signature
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": sig["hidden_size"],
              "vocab_size": sig["vocab_size"], "medusa_num_heads": heads.num_heads,
              "medusa_num_layers": heads.num_layers, "medusa_fc_bias": True, "torch_dtype": "float16"}
    lm_head = target.get_output_embeddings().weight
    tensors = {}
    for h, block in enumerate(heads.blocks):
        for l, res in enumerate(block):
            tensors[f"blocks.{h}.layers.{l}.weight"] = res.linear.weight
            tensors[f"blocks.{h}.layers.{l}.bias"] = res.linear.bias
        tensors[f"lm_heads.{h}.weight"] = lm_head
    return config, tensors


def export_head(head: EagleHead | MedusaHeads, fmt: str, out: str | Path, target: PreTrainedModel | None = None,
                dtype: torch.dtype = torch.float16) -> Path:
    """Write `head` in engine format `fmt` to `out` (config.json + model.safetensors), atomically."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "vllm-medusa":
        if not isinstance(heads := head, MedusaHeads):
            raise ConfigError(f"--format vllm-medusa needs Medusa heads, got {type(head).__name__}")
        if target is None:
            raise ConfigError("--format vllm-medusa copies the target's LM head into each head: pass the target")
        check_target(heads.signature, target, "the heads to export")
        config, tensors = _medusa_files(heads, target)
    else:
        if not isinstance(head, EagleHead):
            raise ConfigError(f"--format {fmt} needs an EAGLE head, got {type(head).__name__}")
        if target is not None:
            check_target(head.signature, target, "the head to export")
        config, tensors = _eagle3_files(head, target, dtype) if fmt == "eagle3" else _eagle_files(head, fmt, dtype)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file({k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
                   for k, v in tensors.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_exported(path: str | Path, target: PreTrainedModel) -> EagleHead | MedusaHeads:
    """Read a head written by `export_head` (or by another tool in the same engine layout) for `target`."""
    from safetensors.torch import load_file

    from specdec.heads.common import load_state, target_signature

    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
        tensors = load_file(str(path / "model.safetensors"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a readable exported head ({exc}); point at an export directory") from exc
    sig = target_signature(target)
    if config.get("model_type") == "medusa":
        saved = {**sig, "hidden_size": config.get("hidden_size"), "vocab_size": config.get("vocab_size")}
        check_target(saved, target, str(path))
        heads = MedusaHeads.init(target, num_heads=int(config["medusa_num_heads"]),
                                 num_layers=int(config.get("medusa_num_layers", 1)))
        lm_head = target.get_output_embeddings().weight
        for h in range(heads.num_heads):
            own = tensors.pop(f"lm_heads.{h}.weight", None)
            if own is None or not torch.allclose(own.to(lm_head.dtype), lm_head, atol=1e-2, rtol=1e-2):
                raise ModelLoadError(f"{path}: Medusa head {h} has its own LM head; specdec's MedusaHeads share the "
                                     "target's, so only heads exported from specdec (or trained that way) load back")
        # blocks.{h}.layers.{l}.{weight,bias} -> blocks.{h}.{l}.linear.{weight,bias}
        renamed = {re.sub(r"^blocks\.(\d+)\.layers\.(\d+)\.", r"blocks.\1.\2.linear.", k): v for k, v in tensors.items()}
        load_state(heads, renamed, str(path))
        return heads
    architectures = config.get("architectures") or []
    if architectures[:1] == ["LlamaForCausalLMEagle3"]:
        return _load_eagle3(path, config, tensors, target)
    if architectures[:1] not in (["LlamaForCausalLM"], ["LlamaForCausalLMEagle"]) or "fc.weight" not in tensors:
        raise ModelLoadError(f"{path} is neither an EAGLE (vllm-eagle / sglang-eagle) nor a Medusa export")
    saved = {**sig, "hidden_size": config.get("hidden_size"), "vocab_size": config.get("vocab_size")}
    check_target(saved, target, str(path))
    bias = tensors.pop("fc.bias", None)
    has_bias = bias is not None and bool(bias.abs().max() > 0)
    head = EagleHead.init(target, fc_bias=has_bias)
    state = {("" if k.startswith("fc.") else "body.") + k: v for k, v in tensors.items()}
    if has_bias:
        state["fc.bias"] = bias
    load_state(head, state, str(path))
    return head


def _load_eagle3(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                 target: PreTrainedModel) -> EagleHead:
    """An eagle3 export back as an EagleHead: the target's LM head shared if lm_head.weight is its rows for
    the whole vocabulary in order, else the head's own over the draft vocabulary."""
    from specdec.heads.common import load_state, target_signature

    sig = target_signature(target)
    saved = {**sig, "hidden_size": config.get("target_hidden_size", config.get("hidden_size")),
             "vocab_size": config.get("vocab_size")}
    check_target(saved, target, str(path))
    eagle_config = config.get("eagle_config") or {}
    layers = eagle_config.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids"))
    layers = tuple(layers) if layers else engine_default_layers(sig["num_hidden_layers"])
    lm_head, d2t = tensors.pop("lm_head.weight", None), tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    if lm_head is None:
        raise ModelLoadError(f"{path}: an eagle3 export needs lm_head.weight; re-export the head")
    draft_to_target = torch.arange(lm_head.shape[0]) + (0 if d2t is None else d2t.long())  # [Vd]
    own = target.get_output_embeddings().weight
    shared = (lm_head.shape[0] == sig["vocab_size"] and bool((draft_to_target == torch.arange(sig["vocab_size"])).all())
              and torch.allclose(lm_head.to(own.dtype), own, atol=1e-2, rtol=1e-2))
    head = EagleHead.init(target, variant="eagle3", feature_layers=layers,
                          draft_vocab_size=None if shared else lm_head.shape[0])
    state = {("body.layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v
             for k, v in tensors.items()}
    if not shared:
        state["lm_head.weight"] = lm_head
        state["draft_to_target"] = draft_to_target
    load_state(head, state, str(path))
    return head
