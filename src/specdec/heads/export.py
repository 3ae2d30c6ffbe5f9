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
* ``eagle3``       EAGLE-3 (`llama_eagle3.py` in both engines) needs a head built on three fused feature
  depths with its own norm and LM head; specdec's EAGLE head is the EAGLE-1/2 layout, so this format is
  refused with an explanation rather than written wrongly.

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


def _eagle_files(head: EagleHead, fmt: str, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    model_type = head.signature["model_type"]
    if model_type not in LLAMA_LAYOUT:
        raise ConfigError(
            f"--format {fmt} writes a Llama decoder layer, but this head's layer is {model_type!r} (its target's "
            "family); the engines' EAGLE loaders cannot express it: serve it with specdec, or train a head for a "
            "Llama-family target"
        )
    if fmt == "vllm-eagle" and head.fc.bias is not None:
        raise ConfigError("--format vllm-eagle needs a bias-free fc (vLLM builds fc with bias=False) but this head "
                          "has an fc bias; export --format sglang-eagle, or train with the default (no bias)")
    config = dict(head.body_config.to_dict())
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "id2label", "label2id",
                "auto_map", "layer_types"):
        config.pop(key, None)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config.update({"architectures": [EAGLE_ARCHITECTURES[fmt]], "model_type": "llama", "num_hidden_layers": 1,
                   "bias": fmt == "sglang-eagle", "tie_word_embeddings": False,
                   "torch_dtype": str(dtype).removeprefix("torch.")})
    tensors = {"fc.weight": head.fc.weight}
    if fmt == "sglang-eagle":
        tensors["fc.bias"] = head.fc.bias if head.fc.bias is not None else torch.zeros(head.fc.out_features)
    for name, value in head.body.state_dict().items():
        tensors[name] = value  # layers.0.* (no input_layernorm: the head has none)
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
    if fmt == "eagle3":
        raise ConfigError(
            "--format eagle3 needs an EAGLE-3 head (fc over three fused target layers, a 2H-input attention, its "
            "own norm and LM head); specdec's EagleHead is the EAGLE-1/2 layout: export --format vllm-eagle or "
            "sglang-eagle instead"
        )
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
        config, tensors = _eagle_files(head, fmt, dtype)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()},
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
