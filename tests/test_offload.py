"""A target loaded with accelerate's device_map (some layers offloaded to disk, moved in by hooks at each
forward) drives the same decode loop: identical tokens to the plainly loaded model."""

from __future__ import annotations

import pytest
import torch
from models import hf_greedy, tiny

import specdec

pytest.importorskip("accelerate")  # in the `test` extra (pyproject.toml)

PROMPT = [(i * 37 + 11) % 96 for i in range(16)]


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("offload")
    model = tiny("llama", hidden=32, layers=3, dtype=torch.float32)
    model.save_pretrained(root / "m")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.layers.2": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    loaded = AutoModelForCausalLM.from_pretrained(root / "m", device_map=device_map, offload_folder=str(root / "off"),
                                                  dtype=torch.float32).eval()
    loaded.generation_config.eos_token_id = None
    assert getattr(loaded, "hf_device_map", {}).get("model.layers.1") == "disk"
    return model, loaded


@pytest.mark.parametrize("kind", ["draft", "eagle", "medusa"])
def test_offloaded_target_decodes_like_the_plain_one(offloaded, kind):
    model, loaded = offloaded
    if kind == "draft":
        drafters = [specdec.DraftModel(model), specdec.DraftModel(model)]
    elif kind == "eagle":
        drafters = [specdec.Eagle(m, specdec.EagleHead.init(model, seed=0), top_k=3, depth=3, max_nodes=8)
                    for m in (model, loaded)]
    else:
        drafters = [specdec.Medusa(m, specdec.MedusaHeads.init(model, seed=0), tree=[(0,), (1,), (0, 0)])
                    for m in (model, loaded)]
    plain = specdec.generate(model, PROMPT, drafter=drafters[0], gamma=3, max_new_tokens=16)
    offload = specdec.generate(loaded, PROMPT, drafter=drafters[1], gamma=3, max_new_tokens=16)
    assert offload.tokens == plain.tokens == hf_greedy(model, PROMPT, 16)
    assert offload.stats.accepted == plain.stats.accepted
