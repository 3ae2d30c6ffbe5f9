"""Tiny models the tests build: random configs of several architectures, and scripted toy LMs."""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

VOCAB = 96


def _common(hidden: int, layers: int, vocab: int) -> dict:
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.2,
    )


def tiny(arch: str = "llama", hidden: int = 32, layers: int = 2, vocab: int = VOCAB, seed: int = 0,
         dtype: torch.dtype = torch.float64, **overrides) -> PreTrainedModel:
    """A random tiny causal LM of architecture `arch`, in eval mode, with no EOS configured."""
    torch.manual_seed(seed)
    if arch == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=512,
                            bos_token_id=None, eos_token_id=None, initializer_range=0.2, **overrides)
        model = GPT2LMHeadModel(config)
    else:
        cls_cfg, cls_model = {
            "llama": (LlamaConfig, LlamaForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM),
            "gemma": (GemmaConfig, GemmaForCausalLM),
        }[arch]
        kwargs = _common(hidden, layers, vocab)
        if arch == "gemma":
            kwargs["head_dim"] = hidden // 4
        kwargs.update(overrides)
        model = cls_model(cls_cfg(**kwargs))
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    return model.to(dtype).eval()


#: Tiny mixture-of-experts configs by model_type (4 experts, 2 a token; DeepSeek-V3's first layer dense, a shared
#: expert beside the routed ones as in Qwen2-MoE's).
MOE_ARCHS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                      shared_expert_intermediate_size=32),
    "qwen3_moe": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4),
}


def tiny_moe(arch: str = "mixtral", hidden: int = 32, layers: int = 2, vocab: int = VOCAB, seed: int = 0,
             dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A random tiny mixture-of-experts causal LM of model_type `arch` (MOE_ARCHS), in eval mode, with no EOS."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, **{**_common(hidden, layers, vocab), **MOE_ARCHS[arch], **overrides})
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    return model.to(dtype).eval()


#: Tiny configs of the families whose MTP layer specdec.Mtp loads (MoE layers of 4 experts, MLA where the family
#: has it), by model_type; `tiny_mtp` adds the layer count, sizes and vocabulary.
MTP_ARCHS = {
    "deepseek_v3": dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4),
    "glm4_moe": dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                     n_shared_experts=1, first_k_dense_replace=1, head_dim=8, partial_rotary_factor=0.5),
    "glm4_moe_lite": dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                          topk_group=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                          qk_nope_head_dim=4, v_head_dim=8, num_key_value_heads=4),
    "mellum": dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=32),
}


def tiny_mtp(path, arch: str = "deepseek_v3", hidden: int = 32, layers: int = 2, vocab: int = VOCAB, seed: int = 0,
             dtype: torch.dtype = torch.float64, mtp: bool = True, scale: float = 0.2) -> PreTrainedModel:
    """A random tiny target of MTP family `arch`, saved to directory `path` as a release is (its first MTP layer's
    tensors in the checkpoint's own layout: `model.layers.{layers}.*` with enorm / hnorm / eh_proj / shared_head,
    or Mellum's `mtp.*`; mtp=False: none) and loaded back with from_pretrained, which drops them; in eval mode,
    no EOS. MoE experts run eagerly (transformers' grouped_mm has no float64 kernel)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = Path(path)
    kwargs = dict(_common(hidden, layers + 1, vocab), **MTP_ARCHS[arch])
    if arch == "mellum":
        # the target alternates sliding-window and full layers (so its rotary embedding knows both kinds); the MTP
        # layer is a sliding-window one, as in the release
        kwargs.update(num_mtp_layers=None, mlp_layer_types=None,
                      layer_types=(["sliding_attention", "full_attention"] * (layers + 1))[: layers + 1])
    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, **kwargs)
    full = AutoModelForCausalLM.from_config(config)  # the target's layers plus one more: the MTP block
    full.save_pretrained(path)
    state = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1)
    block = {k[len(f"model.layers.{layers}."):]: state.pop(k) for k in list(state)
             if k.startswith(f"model.layers.{layers}.")}
    if mtp:
        extra = {
            "enorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
            "hnorm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
            "eh_proj.weight": scale * torch.randn(hidden, 2 * hidden, generator=gen),
            "shared_head.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=gen),
        }
        if arch == "mellum":  # Qwen3-Next's layout: mtp.fc, mtp.pre_fc_norm_*, mtp.layers.0.*, mtp.norm
            names = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
                     "eh_proj.weight": "fc.weight", "shared_head.norm.weight": "norm.weight"}
            state.update({f"mtp.{names[k]}": v for k, v in extra.items()})
            state.update({f"mtp.layers.0.{k}": v for k, v in block.items()})
        else:  # DeepSeek-V3's: the layer after the last, with copies of the embedding and the LM head
            extra["shared_head.head.weight"] = state["lm_head.weight"].clone()
            extra["embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
            state.update({f"model.layers.{layers}.{k}": v for k, v in {**block, **extra}.items()})
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    saved = json.loads((path / "config.json").read_text())
    saved["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_layer_types"):
        if saved.get(key):
            saved[key] = saved[key][:layers]
    if "num_nextn_predict_layers" in saved or arch == "mellum":
        saved["num_nextn_predict_layers"] = 1 if mtp else 0
    if arch == "mellum" and mtp:
        saved["mtp_layer_types"], saved["mtp_mlp_layer_types"] = ["sliding_attention"], ["sparse"]
    (path / "config.json").write_text(json.dumps(saved))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists the MTP tensors a small target does not ignore
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager")
    finally:
        hf_logging.set_verbosity(verbosity)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def perturbed(model: PreTrainedModel, scale: float, seed: int = 1) -> PreTrainedModel:
    """A copy of `model` with Gaussian noise (std `scale` x each tensor's std) added to every weight."""
    import copy

    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype)
            param.add_(noise * scale * (param.std() if param.numel() > 1 else 1.0))
    return other


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int, eos=None) -> list[int]:
    """Reference: transformers' own greedy generate, new tokens only."""
    out = model.generate(
        torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=max_new_tokens,
        eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                                   device=model.device),
    )
    return out[0, len(prompt):].tolist()


class ScriptedConfig(PreTrainedConfig):
    model_type = "specdec-scripted"

    def __init__(self, vocab_size: int = 8, **kwargs):
        self.vocab_size = vocab_size
        self.max_position_embeddings = 4096
        super().__init__(**kwargs)


class ScriptedLM(PreTrainedModel):
    """A causal LM whose next-token distribution depends only on the position: `table(position) -> probs [V]`.

    It keeps a real DynamicCache (one dummy layer), so cropping and cache lengths behave as for a transformer.
    """

    config_class = ScriptedConfig
    base_model_prefix = "scripted"

    def __init__(self, table, vocab_size: int = 8):
        super().__init__(ScriptedConfig(vocab_size=vocab_size))
        self.table = table
        self.lm_head = nn.Linear(1, vocab_size, bias=False)
        self.seen_positions: list[int] = []

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, position_ids=None, past_key_values=None, use_cache=True,
                logits_to_keep=0, **kwargs):
        n = input_ids.shape[1]
        positions = position_ids[0].tolist()
        dummy = torch.zeros(1, 1, n, 1, dtype=torch.float64)
        past_key_values.update(dummy, dummy, 0)
        assert past_key_values.get_seq_length() == positions[-1] + 1, "positions must follow the cache"
        self.seen_positions.extend(positions)
        probs = torch.stack([torch.as_tensor(self.table(p), dtype=torch.float64) for p in positions])
        logits = probs.clamp_min(1e-300).log()[None]  # [1, n, V]
        if logits_to_keep == 1:
            logits = logits[:, -1:]
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)


def one_hot_table(sequence: list[int], vocab_size: int = 8):
    """Greedy script: after position p the most likely next token is sequence[p + 1] (repeating the last)."""

    def table(position: int) -> torch.Tensor:
        probs = torch.full((vocab_size,), 0.5 / (vocab_size - 1), dtype=torch.float64)
        probs[sequence[min(position + 1, len(sequence) - 1)]] = 0.5
        return probs

    return table


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained in memory on a little Python (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


class PrefixScriptedLM(PreTrainedModel):
    """A causal LM whose next-token distribution is `table(prefix) -> probs [V]` of the tokens a row sees.

    The KV cache holds each token id as its "key" (one dummy layer), so a row's prefix is read back from
    the cache through the attention mask: a 4D tree mask is honoured, and a cache that kept the wrong rows
    after a tree commit shows up as a wrong prefix. Position ids must equal the prefix length − 1.
    """

    config_class = ScriptedConfig
    base_model_prefix = "scripted"

    def __init__(self, table, vocab_size: int = 8):
        super().__init__(ScriptedConfig(vocab_size=vocab_size))
        self.table = table
        self.lm_head = nn.Linear(1, vocab_size, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, position_ids=None, past_key_values=None, use_cache=True,
                logits_to_keep=0, attention_mask=None, **kwargs):
        n = input_ids.shape[1]
        ids = input_ids.to(torch.float64).view(1, 1, n, 1)
        keys, _ = past_key_values.update(ids, ids, 0)  # [1, 1, L, 1]
        tokens = keys.view(-1).long().tolist()
        total = len(tokens)
        if attention_mask is None:
            visible = torch.ones(n, total, dtype=torch.bool).tril(total - n)
        else:
            visible = attention_mask[0, 0] == 0  # [n, L]
        rows = []
        for i in range(n):
            prefix = tuple(t for t, v in zip(tokens, visible[i].tolist()) if v)
            assert int(position_ids[0, i]) == len(prefix) - 1, "position id must be the prefix length - 1"
            rows.append(torch.as_tensor(self.table(prefix), dtype=torch.float64))
        logits = torch.stack(rows).clamp_min(1e-300).log()[None]  # [1, n, V]
        if logits_to_keep == 1:
            logits = logits[:, -1:]
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)


def cached_tokens(cache) -> list[int]:
    """The token ids a PrefixScriptedLM's cache holds."""
    return cache.layers[0].keys.view(-1).long().tolist() if cache.get_seq_length() else []
