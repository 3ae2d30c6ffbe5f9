"""Engine exports: every key and shape each loader reads, refusals, and round trips back into specdec.

Expected layouts are written down from the engines' loader code (read through the research notes,
/work/shared/research/trees_heads.md §5):
- vLLM EAGLE-1/2: vllm/model_executor/models/llama_eagle.py (EagleLlamaForCausalLM: fc bias=False, layer-0
  input_layernorm replaced by Identity, no final norm, "model." prefix added by the loader, lm_head shared);
  vllm/transformers_utils/configs/eagle.py (architecture renamed to "Eagle" + arch).
- SGLang EAGLE-1/2: python/sglang/srt/models/llama_eagle.py (LlamaForCausalLMEagle: fc with bias).
- vLLM Medusa: vllm/model_executor/models/medusa.py (blocks.{h}.layers.{l}, lm_heads.{h}) and
  vllm/transformers_utils/configs/medusa.py (model_type "medusa", medusa_num_heads / medusa_num_layers,
  medusa_fc_bias).
- EAGLE-3: vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM.load_weights: "midlayer." ->
  "layers.0.", q/k/v stacked into qkv_proj with input 2H, fc = ReplicatedLinear(3 * target_hidden_size, H,
  bias=False), norm, lm_head [draft_vocab_size, H], d2t -> draft_id_to_target_id with target = i + d2t[i]
  (a parameter vLLM creates only when draft_vocab_size differs from the target's vocabulary: d2t is written
  for a reduced draft vocabulary only), t2d skipped; eagle_config.eagle_aux_hidden_state_layer_ids read as-is), python/sglang/srt/models/
  llama_eagle3.py (LlamaForCausalLMEagle3: same names, hot_token_id = d2t + arange) and NVIDIA
  Model-Optimizer modelopt/torch/export/plugins/hf_spec_export.py (LLAMA_EAGLE_SINGLE_LAYER required keys).
  An EAGLE-1/2 head cannot be written as eagle3 (nor the reverse): refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from models import hf_greedy, tiny
from safetensors.torch import load_file

import specdec
from specdec.errors import ConfigError
from specdec.heads.export import export_head, load_exported

H, FFN, HEADS, KV_HEADS, V = 32, 64, 4, 2, 96
HEAD_DIM = H // HEADS
LLAMA_LAYER = {
    "layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
    "layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, H),
    "layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, H),
    "layers.0.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
    "layers.0.mlp.gate_proj.weight": (FFN, H),
    "layers.0.mlp.up_proj.weight": (FFN, H),
    "layers.0.mlp.down_proj.weight": (H, FFN),
    "layers.0.post_attention_layernorm.weight": (H,),
}
#: EAGLE-3's midlayer: q/k/v read cat(input_layernorm(embed), hidden_norm(h)) [2H]; hidden_norm is extra.
MIDLAYER = {
    "midlayer.self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
    "midlayer.mlp.gate_proj.weight": (FFN, H),
    "midlayer.mlp.up_proj.weight": (FFN, H),
    "midlayer.mlp.down_proj.weight": (H, FFN),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.post_attention_layernorm.weight": (H,),
}
VD = V // 2  # the reduced draft vocabulary of the "eagle3-reduced" case: every other token id
EXPECTED = {
    "eagle3": {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (V, H), **MIDLAYER},
    "eagle3-reduced": {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (VD, H), "d2t": (VD,),
                       "t2d": (V,), **MIDLAYER},
    "vllm-eagle": {"fc.weight": (H, 2 * H), **LLAMA_LAYER},
    "sglang-eagle": {"fc.weight": (H, 2 * H), "fc.bias": (H,), **LLAMA_LAYER},
    "vllm-medusa": {
        **{f"blocks.{h}.layers.0.weight": (H, H) for h in range(4)},
        **{f"blocks.{h}.layers.0.bias": (H,) for h in range(4)},
        **{f"lm_heads.{h}.weight": (V, H) for h in range(4)},
    },
}
PROMPT = [(i * 37 + 11) % 96 for i in range(20)]


@pytest.fixture(scope="module")
def target():
    return tiny("llama", hidden=H, layers=2)


def _head(target, case):
    if case == "vllm-medusa":
        return specdec.MedusaHeads.init(target, num_heads=4, seed=2)
    if case.startswith("eagle3"):
        head = specdec.EagleHead.init(target, seed=2, variant="eagle3")
        return head.with_draft_vocab(target, range(0, V, 2)) if case == "eagle3-reduced" else head
    return specdec.EagleHead.init(target, seed=2)


def _format(case):
    return "eagle3" if case.startswith("eagle3") else case


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_every_key_and_shape_the_loader_reads(tmp_path, target, case):
    fmt = _format(case)
    export_head(_head(target, case), fmt, tmp_path / "out", target=target)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == EXPECTED[case]
    assert all(v.dtype == {"d2t": torch.int64, "t2d": torch.bool}.get(k, torch.float16) for k, v in tensors.items())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    if fmt == "eagle3":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
        assert (config["num_hidden_layers"], config["bias"], config["norm_before_residual"]) == (1, False, False)
        assert (config["hidden_size"], config["target_hidden_size"], config["vocab_size"]) == (H, H, V)
        assert config["draft_vocab_size"] == EXPECTED[case]["lm_head.weight"][0]
        # (0, 1, 1) on this 2-layer target differs from the engines' default (2, N//2, N-3): written out.
        assert config["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
        if case == "eagle3-reduced":
            draft_ids = torch.arange(config["draft_vocab_size"]) + tensors["d2t"]  # vLLM: target id = i + d2t[i]
            assert torch.equal(draft_ids, torch.arange(0, V, 2))
            assert torch.equal(tensors["t2d"].nonzero()[:, 0], draft_ids)
        else:  # the shared LM head is written as the target's rows; no d2t, which vLLM refuses at full vocabulary
            assert config["draft_vocab_size"] == V and "d2t" not in tensors and "t2d" not in tensors
            assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight.to(torch.float16))
    elif fmt == "vllm-medusa":
        assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
        assert (config["medusa_num_heads"], config["medusa_num_layers"], config["medusa_fc_bias"]) == (4, 1, True)
        assert (config["hidden_size"], config["vocab_size"]) == (H, V)
    else:
        assert config["architectures"] == [{"vllm-eagle": "LlamaForCausalLM", "sglang-eagle": "LlamaForCausalLMEagle"}[fmt]]
        assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
        assert config["bias"] is (fmt == "sglang-eagle")
        assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (H, FFN, V)
        assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
        assert "layers.0.input_layernorm.weight" not in tensors and "lm_head.weight" not in tensors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the temporary directory was renamed


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_exported_head_loads_back_and_drafts_the_same_tokens(tmp_path, target, case):
    fmt = _format(case)
    head = _head(target, case)
    head = head.to(torch.float16).to(torch.float64)  # what survives a float16 export
    export_head(head, fmt, tmp_path / "out", target=target)
    again = load_exported(tmp_path / "out", target)
    assert type(again) is type(head)
    for (ka, a), (kb, b) in zip(sorted(head.state_dict().items()), sorted(again.state_dict().items()), strict=True):
        assert ka == kb and torch.equal(a, b), ka
    make = (lambda h: specdec.Medusa(target, h)) if fmt == "vllm-medusa" else (lambda h: specdec.Eagle(target, h))
    runs = [specdec.generate(target, PROMPT, drafter=make(h), gamma=3, max_new_tokens=16) for h in (head, again)]
    proposals = []
    for h in (head, again):
        drafter = make(h)
        drafter.reset(torch.tensor(PROMPT), hidden=_features(target, PROMPT[:-1], drafter.capabilities.needs_hidden))
        proposals.append(drafter.propose(torch.tensor(PROMPT), 3, specdec.SamplingConfig(0.0), None).tokens)
    assert torch.equal(proposals[0], proposals[1])
    assert runs[0].tokens == runs[1].tokens == hf_greedy(target, PROMPT, 16)
    assert runs[0].stats.accepted == runs[1].stats.accepted


def _features(target, tokens, request):
    from specdec.runtime.base import select_hidden

    with torch.no_grad():
        return select_hidden(target(torch.tensor([tokens]), output_hidden_states=True).hidden_states, request)


def test_formats_the_head_cannot_express_are_refused_and_nothing_is_written(tmp_path, target):
    eagle = specdec.EagleHead.init(target)
    with pytest.raises(ConfigError, match="EAGLE-3"):
        export_head(eagle, "eagle3", tmp_path / "a", target=target)
    with pytest.raises(ConfigError, match="needs Medusa heads"):
        export_head(eagle, "vllm-medusa", tmp_path / "b", target=target)
    with pytest.raises(ConfigError, match="needs an EAGLE head"):
        export_head(specdec.MedusaHeads.init(target), "vllm-eagle", tmp_path / "c", target=target)
    qwen = tiny("qwen2", hidden=H, layers=2)
    with pytest.raises(ConfigError, match="'qwen2'"):
        export_head(specdec.EagleHead.init(qwen), "vllm-eagle", tmp_path / "d", target=qwen)
    with pytest.raises(ConfigError, match="bias-free"):
        export_head(specdec.EagleHead.init(target, fc_bias=True), "vllm-eagle", tmp_path / "e", target=target)
    with pytest.raises(ConfigError, match="unknown export format"):
        export_head(eagle, "onnx", tmp_path / "f", target=target)
    eagle3 = specdec.EagleHead.init(target, variant="eagle3")
    for i, fmt in enumerate(("vllm-eagle", "sglang-eagle")):  # the reverse: an EAGLE-3 head as EAGLE-1/2
        with pytest.raises(ConfigError, match="--format eagle3"):
            export_head(eagle3, fmt, tmp_path / f"g{i}", target=target)
    final = specdec.EagleHead.init(target, variant="eagle3", feature_layers=(0, 1, 2))  # 2 = the final normed state
    with pytest.raises(ConfigError, match="input of a target layer"):
        export_head(final, "eagle3", tmp_path / "h", target=target)
    with pytest.raises(ConfigError, match="'qwen2'"):
        export_head(specdec.EagleHead.init(qwen, variant="eagle3"), "eagle3", tmp_path / "i", target=qwen)
    assert list(tmp_path.iterdir()) == []


def test_sglang_export_keeps_a_trained_fc_bias(tmp_path, target):
    head = specdec.EagleHead.init(target, fc_bias=True)
    with torch.no_grad():
        head.fc.bias.uniform_(-0.5, 0.5)
    head = head.to(torch.float16).to(torch.float64)
    export_head(head, "sglang-eagle", tmp_path / "out", target=target)
    again = load_exported(tmp_path / "out", target)
    assert torch.equal(again.fc.bias, head.fc.bias)


def test_cli_export_writes_the_layout(tmp_path, target, monkeypatch, capsys):
    from specdec.cli import main

    specdec.EagleHead.init(target).save(tmp_path / "head")
    monkeypatch.setattr("specdec.hub.loading.load_model", lambda *a, **k: target)
    assert main(["export", "--format", "sglang-eagle", "--head", str(tmp_path / "head"), "--target", "x",
                 "--out", str(tmp_path / "out")]) == 0
    assert set(load_file(str(tmp_path / "out" / "model.safetensors"))) == set(EXPECTED["sglang-eagle"])
    assert main(["export", "--format", "eagle3", "--head", str(tmp_path / "head"), "--target", "x",
                 "--out", str(tmp_path / "o3")]) == 2
    assert "EAGLE-3" in capsys.readouterr().err
    specdec.EagleHead.init(target, variant="eagle3").save(tmp_path / "head3")
    assert main(["export", "--format", "eagle3", "--head", str(tmp_path / "head3"), "--target", "x",
                 "--out", str(tmp_path / "o3")]) == 0
    assert set(load_file(str(tmp_path / "o3" / "model.safetensors"))) == set(EXPECTED["eagle3"])


@pytest.mark.parametrize("fmt", ["vllm-eagle", "eagle3", "vllm-medusa"])
def test_cli_exports_the_shipped_default_heads(tmp_path, fmt):
    from specdec.cli import main

    assert main(["export", "--format", fmt, "--head", "default", "--out", str(tmp_path / "out")]) == 0
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    target, _, _ = specdec.load_default()
    expected = {k for k in EXPECTED[fmt] if not k.startswith(("blocks.", "lm_heads."))} if fmt == "vllm-eagle" else None
    if fmt == "vllm-eagle":
        assert set(tensors) == expected and tuple(tensors["fc.weight"].shape) == (384, 768)
    elif fmt == "eagle3":  # the shipped EAGLE-3 head reads out through the target's LM head: no d2t / t2d
        assert "d2t" not in tensors and "t2d" not in tensors
        assert tuple(tensors["fc.weight"].shape) == (384, 3 * 384) and tuple(tensors["lm_head.weight"].shape) == (8192, 384)
    else:
        assert tuple(tensors["lm_heads.0.weight"].shape) == (8192, 384)
    again = load_exported(tmp_path / "out", target)
    shipped = specdec.load_default_heads(target)[{"vllm-eagle": "eagle", "eagle3": "eagle3"}.get(fmt, "medusa")]
    for a, b in zip(shipped.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
