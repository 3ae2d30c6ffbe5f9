"""The target's own multi-token-prediction (MTP) layer, loaded from its checkpoint beside the target.

DeepSeek-V3 / R1, GLM-4.5 / 4.6, GLM-4.7-Flash and Mellum ship an MTP layer trained with the model:

    g_t = post_norm( block( eh_proj( cat(enorm(embed(x_{t+1})), hnorm(h_t)) ) ) )     logits_t = lm_head(g_t)

where h_t is the target's final (normed) hidden state at position t, `block` is one decoder layer of the
model's own family, and logits_t predicts x_{t+2}: one token beyond the target's own next-token prediction.
The token embedding and the LM head are the target's.

What transformers 5.24 does with these weights: the causal-LM classes list them in
`_keys_to_ignore_on_load_unexpected` (DeepSeek-V3 `model.layers.61.*`, GLM-4.5 `model.layers.46.*` / `92.*`,
GLM-4.7-Flash `model.layers.47.*`, Mellum `mtp.*`), so `from_pretrained` drops them silently and a loaded target
has no MTP layer; `save_pretrained` then writes a checkpoint without them. transformers keeps a separate
`transformers.modeling_layers.MtpModel` (its `generate(use_mtp=True)` drafter) that rebuilds the layer from the
target: `MtpLayer` parts (enorm, hnorm, eh_proj, post_norm) around the family's own decoder-layer class, built
from the config's MTP view (`get_mtp_config`), with the embedding, LM head and rotary embedding shared with the
target. `load_mtp` builds that module and loads the first MTP layer's tensors into it from the checkpoint's
safetensors with transformers' own weight conversions (expert stacking, renames), selecting the tensors by the
target's actual layer count rather than the release's hard-coded layer number. For GLM-4.7-Flash, whose
transformers config declares no MTP layer, the MTP view is a copy of the target's config that declares one, its
block shaped as the target's last decoder layer; the target's own config is never changed.

Refused, with the reason (`UnsupportedModelError`): Qwen3-Next and Qwen3.5 (their checkpoints carry an MTP layer,
`mtp.*`, which transformers drops, but their linear-attention layers keep a recurrent state that specdec cannot
roll back after a rejected draft, so they cannot be a target at all), MiMo-V2-Flash (its MTP block is a dense
sliding-window layer, not one of its decoder layers) and every other family; a checkpoint without MTP tensors
(`ModelLoadError`): a re-saved or converted copy, or a model that never had them.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from packaging.version import Version
from transformers import PreTrainedModel
from transformers import __version__ as TRANSFORMERS_VERSION

from specdec.errors import ModelLoadError, UnsupportedModelError

#: Families whose MTP layer `load_mtp` loads (tested on tiny random configs of each, tests/test_mtp.py), and
#: where their checkpoints keep it: "layers" = the decoder layer after the last one, `model.layers.{N}.*`
#: (DeepSeek-V3's layout); "mtp" = a separate `mtp.*` block (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.layers.0.*`,
#: `mtp.norm`: Qwen3-Next's layout).
LAYOUTS = {
    "deepseek_v3": "layers",  # DeepSeek-V3 / R1 / V3.1: model.layers.61.*
    "glm4_moe": "layers",  # GLM-4.5 / 4.6: model.layers.92.*, GLM-4.5-Air: model.layers.46.*
    "glm4_moe_lite": "layers",  # GLM-4.7-Flash: model.layers.47.*
    "mellum": "mtp",  # Mellum: mtp.*
}

#: Families that ship MTP layers but that specdec does not draft with, and why (the refusal's message).
_RECURRENT = ("keeps a recurrent state in its linear-attention layers that cannot be rolled back after a rejected "
              "draft, so specdec cannot verify drafts for it at all (it refuses it as a target)")
REFUSED = {
    "qwen3_next": _RECURRENT,
    "qwen3_5": _RECURRENT,
    "qwen3_5_moe": _RECURRENT,
    "mimo_v2_flash": ("has an MTP block (dense sliding-window attention) that is not one of its decoder layers, "
                      "so it cannot be built from the model's own layer class"),
}


def family(model: PreTrainedModel) -> str:
    """The target's model_type (its text config's)."""
    return str(model.config.get_text_config().model_type)


#: The first transformers release whose `MtpModel` maps a checkpoint's MTP tensors onto its own layout
#: (`MtpModel.get_weight_conversions`, which `load_mtp` loads through); 5.17 to 5.19 have the class without it.
MIN_TRANSFORMERS = "5.20"


def check_supported(model: PreTrainedModel) -> None:
    """UnsupportedModelError unless `model` is a family whose MTP layer `load_mtp` can load with the transformers
    installed."""
    kind = family(model)
    if kind in LAYOUTS:
        if Version(TRANSFORMERS_VERSION) < Version(MIN_TRANSFORMERS):
            raise UnsupportedModelError(
                f"specdec.Mtp loads a release's MTP layer through transformers' MtpModel weight conversions, which "
                f"transformers {MIN_TRANSFORMERS} added; this environment has transformers {TRANSFORMERS_VERSION}: "
                f"upgrade it (pip install 'transformers>={MIN_TRANSFORMERS}'), or draft with another method "
                "(DraftModel, Eagle, PromptLookup)")
        return
    supported = ", ".join(sorted(LAYOUTS))
    if kind in REFUSED:
        raise UnsupportedModelError(
            f"{type(model).__name__} ({kind}) ships an MTP layer, but it {REFUSED[kind]}; draft for it with another "
            f"method, or use an MTP family specdec supports ({supported})")
    raise UnsupportedModelError(
        f"specdec.Mtp drafts with the MTP layers of {supported} models; {type(model).__name__} ({kind}) is not one "
        "of them (transformers builds no MTP layer for it, or specdec does not load it yet): use another drafter "
        "(DraftModel, Eagle, PromptLookup)")


def mtp_prefixes(model: PreTrainedModel) -> tuple[str, ...]:
    """Checkpoint key prefixes of the target's first MTP layer (its shared tensors included)."""
    if LAYOUTS[family(model)] == "layers":
        n = int(model.config.get_text_config().num_hidden_layers)
        return (f"model.layers.{n}.",)
    return ("mtp.", "model.mtp.")


def _is_first_layer(key: str, prefixes: tuple[str, ...]) -> bool:
    """Is `key` one of the first MTP layer's tensors? (An "mtp" block's further layers, mtp.layers.{k>=1}, are not.)"""
    for prefix in prefixes:
        if key.startswith(prefix):
            deeper = re.match(r"layers\.(\d+)\.", key[len(prefix):])
            return deeper is None or deeper.group(1) == "0" or prefix.startswith("model.layers.")
    return False


def checkpoint_source(model: PreTrainedModel, checkpoint: str | Path | None) -> str:
    """Where the target's weights came from: `checkpoint`, or the path / hub id it was loaded from."""
    source = str(checkpoint) if checkpoint is not None else str(model.config.name_or_path or "")
    if not source:
        raise ModelLoadError(
            f"{type(model).__name__} was not loaded from a checkpoint (its config names none), so specdec.Mtp cannot "
            "find its MTP layer: pass checkpoint=PATH, the directory or hub id of the release it was loaded from")
    return source


def _resolve(source: str, filename: str) -> Path | None:
    """A checkpoint file: from a local directory, else from the hub (the cache from_pretrained filled)."""
    local = Path(source)
    if local.is_dir():
        path = local / filename
        return path if path.is_file() else None
    if local.exists():
        raise ModelLoadError(f"{source} is a file, not a checkpoint directory; pass the directory the target was "
                             "loaded from")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(source, filename))
    except (EntryNotFoundError, LocalEntryNotFoundError):
        return None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {filename} of {source} ({type(exc).__name__}: {exc}); pass "
                             "checkpoint=PATH, a local copy of the release") from exc


def mtp_tensor_files(source: str, prefixes: tuple[str, ...]) -> dict[str, Path]:
    """{checkpoint key: safetensors file} of the first MTP layer's tensors in `source` (empty: it has none)."""
    from safetensors import SafetensorError, safe_open

    index = _resolve(source, "model.safetensors.index.json")
    if index is not None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({exc}); re-download the checkpoint") \
                from exc
        keys = {k: f for k, f in weight_map.items() if _is_first_layer(k, prefixes)}
        return {k: _resolve(source, f) or index.parent / f for k, f in keys.items()}
    single = _resolve(source, "model.safetensors")
    if single is None:
        raise ModelLoadError(
            f"{source} holds no safetensors weights (model.safetensors or model.safetensors.index.json), where "
            "specdec.Mtp reads the MTP layer; point checkpoint= at the release's safetensors checkpoint")
    try:
        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys() if _is_first_layer(k, prefixes)}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{single} is not a readable safetensors file ({type(exc).__name__}: {exc}); "
                             "re-download the checkpoint") from exc


def mtp_view(model: PreTrainedModel) -> PreTrainedModel:
    """The target as transformers' MtpModel reads it, its config declaring one MTP layer: the target itself
    where its config declares MTP layers, else a shallow copy (every module shared) with a copy of the config
    that declares one, shaped as the target's last decoder layer. The target's own config is left as it is."""
    text = model.config.get_text_config()
    layers = text.to_dict()
    if layers.get("num_mtp_layers") == 1 and model.config is text:
        return model
    config = copy.deepcopy(text)
    config.num_mtp_layers = 1
    if layers.get("layer_types") is not None and layers.get("mtp_layer_types") is None:
        config.mtp_layer_types = [text.layer_types[-1]]
    if layers.get("mlp_layer_types") is not None and layers.get("mtp_mlp_layer_types") is None:
        config.mtp_mlp_layer_types = [text.mlp_layer_types[-1]]
    view = copy.copy(model)  # the same modules and parameters; only `config` differs
    view.config = config
    return view


def load_mtp(model: PreTrainedModel, checkpoint: str | Path | None = None):
    """transformers' `MtpModel` holding the first MTP layer of `model`, loaded from `checkpoint` (default: the
    path or hub id the target was loaded from), in the target's dtype and on its last layer's device; its
    embedding, LM head and rotary embedding are the target's. Raises UnsupportedModelError for a family without
    a loadable MTP layer and ModelLoadError for a checkpoint without (or with partial) MTP tensors."""
    from safetensors import safe_open
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_layers import MtpModel
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import ContextManagers

    check_supported(model)
    source = checkpoint_source(model, checkpoint)
    prefixes = mtp_prefixes(model)
    files = mtp_tensor_files(source, prefixes)
    blocks = [k for k in files if not k.endswith(("embed_tokens.weight", "shared_head.head.weight"))]
    if not blocks:
        where = " or ".join(f"{p}*" for p in prefixes)
        raise ModelLoadError(
            f"{source} carries no MTP weights (no tensors under {where}, where {family(model)} checkpoints keep their "
            "MTP layer). transformers drops them when it loads the model and save_pretrained does not write them "
            "back, so a re-saved, converted or quantized copy lacks them: point checkpoint= at the original release, "
            "or draft with another method (DraftModel, Eagle, PromptLookup)")
    view = mtp_view(model)
    dtype = next(model.parameters()).dtype
    device = next(model.get_decoder().layers[-1].parameters()).device
    with ContextManagers(MtpModel.get_init_context(dtype, False, False, None)):
        mtp = MtpModel(view, 1)  # on the meta device: every parameter must come from the checkpoint
    handles = {}
    try:
        state = {}
        for key, path in files.items():
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt", device="cpu")
            state[key] = handles[path].get_slice(key)
        info, _ = convert_and_load_state_dict_in_model(
            model=mtp, state_dict=state,
            load_config=LoadStateDictConfig(weight_mapping=mtp.get_weight_conversions(view),
                                            device_map={"": device}, dtype=dtype))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    mtp.tie_with_main_model(model)  # the target's embedding, LM head and rotary embedding
    missing = sorted(k for k in info.missing_keys if not k.startswith(("embed_tokens.", "shared_head.")))
    unloaded = sorted(name for name, p in mtp.named_parameters() if p.device.type == "meta")
    if missing or unloaded:
        raise ModelLoadError(
            f"the MTP layer in {source} is partial or of another layout (missing {', '.join((missing or unloaded)[:6])}"
            f"); it does not fit {type(model).__name__}'s MTP layer: re-download the checkpoint, or load the target "
            "from the release the MTP weights belong to")
    return mtp.eval().requires_grad_(False)
