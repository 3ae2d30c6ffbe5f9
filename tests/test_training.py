"""Tests of the training stack: corpus, tokenizer, train/resume, distillation, acceptance proxy, default pair."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from specdec.training import corpus
from specdec.training.evaluate import acceptance_from_logits, acceptance_proxy

N_FILES = 12  # files per split the data pipeline sees in these tests (keeps tokenizing fast)


@pytest.fixture(scope="module")
def small_corpus() -> dict[str, list[str]]:
    """The first few files of each split (sorted order), truncated, so tests tokenize little."""
    return {split: [t[:20000] for t in corpus.read_corpus(split)[:N_FILES]] for split in ("train", "heldout")}


@pytest.fixture()
def patched_corpus(monkeypatch, small_corpus):
    """Make the data pipeline read the small corpus instead of the whole stdlib."""
    monkeypatch.setattr(corpus, "read_corpus", lambda split="train", root=None: small_corpus[split])


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory, small_corpus):
    """A 400-token byte-level BPE trained on the small train corpus, saved to disk."""
    from specdec.training.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(small_corpus["train"], vocab_size=400, out_dir=path)
    return path


# --------------------------------------------------------------------------- corpus


def test_split_is_deterministic_disjoint_and_complete():
    train, heldout, every = corpus.stdlib_files("train"), corpus.stdlib_files("heldout"), corpus.stdlib_files("all")
    assert train == corpus.stdlib_files("train") and heldout == corpus.stdlib_files("heldout")
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sorted(every)
    assert 0.01 < len(heldout) / len(every) < 0.06
    rels = [p.relative_to(corpus.stdlib_root()).as_posix() for p in train]
    assert rels == sorted(rels)


def test_no_test_packages_or_site_packages():
    for path in corpus.stdlib_files("all"):
        rel = path.relative_to(corpus.stdlib_root())
        assert path.suffix == ".py"
        assert not {"test", "tests", "idle_test", "site-packages"} & set(rel.parts[:-1]), rel
        assert not rel.as_posix().startswith("lib2to3/tests")


def test_bad_split_raises():
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError):
        corpus.stdlib_files("validation")


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_and_loads(tiny_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    text = 'def f(x):\n\t"""Doc ü — ✓."""\n    return {x: [1, 2]}  # end\n'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id
    assert len(tok) == 400


def test_encode_corpus_separates_files_with_eos(tiny_tokenizer):
    from transformers import AutoTokenizer

    from specdec.training.tokenizer import encode_corpus

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    ids = encode_corpus(tok, ["a = 1\n", "b = 2\n"])
    assert (ids == tok.eos_token_id).sum() == 2 and ids[-1] == tok.eos_token_id


def test_heldout_prompts_deterministic(tiny_tokenizer, small_corpus, patched_corpus):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    first = corpus.heldout_prompts(tok, 4, 24, seed=3)
    assert first == corpus.heldout_prompts(tok, 4, 24, seed=3)
    assert all(len(p) == 24 for p in first)
    heldout_text = "\n".join(small_corpus["heldout"])
    for prompt in first:
        text = tok.decode(prompt)
        assert ("\n" + text) in ("\n" + heldout_text)  # cut at a line start


# --------------------------------------------------------------------------- training


def _train_args(out: Path, tokenizer: Path, steps: int) -> list[str]:
    return ["train", "--out", str(out), "--tokenizer", str(tokenizer), "--hidden-size", "32", "--layers", "1",
            "--heads", "2", "--intermediate-size", "64", "--steps", str(steps), "--batch-size", "2", "--seq-len", "32",
            "--checkpoint-every", "3", "--eval-every", "3", "--eval-tokens", "256", "--warmup-steps", "2",
            "--save-dtype", "float16"]


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoint.pt", weights_only=False)["model"]


def test_train_checkpoint_and_resume_match_uninterrupted(tmp_path, tiny_tokenizer, patched_corpus, monkeypatch):
    from specdec.cli import main
    from specdec.training import train as train_module

    full, broken = tmp_path / "full", tmp_path / "broken"
    assert main(_train_args(full, tiny_tokenizer, 7)) == 0
    assert (full / "model.safetensors").is_file() and (full / "checkpoint.pt").is_file()

    real_sample = train_module.sample_batch

    def interrupt_at_5(tokens, step, *args):
        if step == 5:
            raise KeyboardInterrupt
        return real_sample(tokens, step, *args)

    monkeypatch.setattr(train_module, "sample_batch", interrupt_at_5)
    assert main(_train_args(broken, tiny_tokenizer, 7)) == 130
    assert torch.load(broken / "checkpoint.pt", weights_only=False)["step"] == 3
    monkeypatch.setattr(train_module, "sample_batch", real_sample)
    assert main(_train_args(broken, tiny_tokenizer, 7) + ["--resume"]) == 0

    a, b = _final_weights(full), _final_weights(broken)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(full))
    assert next(model.parameters()).dtype == torch.float16


def test_train_refuses_to_overwrite_and_bad_shape(tmp_path, tiny_tokenizer, patched_corpus, capsys):
    from specdec.cli import main

    out = tmp_path / "run"
    assert main(_train_args(out, tiny_tokenizer, 1)) == 0
    assert main(_train_args(out, tiny_tokenizer, 1)) == 2  # existing checkpoint, no --resume
    bad = _train_args(tmp_path / "bad", tiny_tokenizer, 1)
    bad[bad.index("--heads") + 1] = "3"
    assert main(bad) == 2
    assert "--heads" in capsys.readouterr().err


# --------------------------------------------------------------------------- acceptance proxy & distillation


def test_acceptance_from_logits_hand_checked():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.9, 0.05, 0.05])
    logits_p, logits_q = torch.log(p.clamp_min(1e-30)), torch.log(q)
    alpha = acceptance_from_logits(logits_p, logits_q, 1.0).item()
    assert alpha == pytest.approx(0.5 + 0.05 + 0.0, abs=1e-6)
    assert acceptance_from_logits(logits_p[None], logits_q[None], 0.0).item() == 1.0  # argmax 0 vs 0
    assert acceptance_from_logits(torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 0.0]]), 0.0).item() == 0.0


def _tiny_llama(vocab: int, hidden: int, layers: int, seed: int, init: float = 0.02):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=2, intermediate_size=2 * hidden, max_position_embeddings=128,
                      tie_word_embeddings=True, initializer_range=init)
    return LlamaForCausalLM(cfg).eval()


def test_acceptance_proxy_identical_models_is_one():
    model = _tiny_llama(50, 16, 1, seed=0, init=0.5)
    other = _tiny_llama(50, 16, 1, seed=1, init=0.5)
    batches = [torch.randint(0, 50, (2, 12)) for _ in range(2)]
    assert acceptance_proxy(model, model, batches, 1.0) == pytest.approx(1.0, abs=1e-5)
    assert acceptance_proxy(model, model, batches, 0.0) == 1.0
    assert 0.0 < acceptance_proxy(model, other, batches, 1.0) < 1.0


def test_distillation_lowers_kl(tmp_path, tiny_tokenizer, patched_corpus):
    from transformers import AutoTokenizer

    from specdec.training.distill import DistillConfig, distill
    from specdec.training.loop import LoopConfig

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    target, draft = _tiny_llama(len(tok), 32, 2, seed=0, init=0.3), _tiny_llama(len(tok), 32, 1, seed=1)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(str(tmp_path / name))
        tok.save_pretrained(str(tmp_path / name))
    cfg = DistillConfig(target=tmp_path / "target", draft=tmp_path / "draft", out=tmp_path / "out",
                        loop=LoopConfig(steps=30, lr=3e-2, warmup_steps=2, eval_every=1000, checkpoint_every=25),
                        batch_size=4, seq_len=32, eval_tokens=512, save_dtype="float32")
    report = distill(cfg, log=lambda _msg: None)
    assert report["after"]["kl_T1"] < 0.95 * report["before"]["kl_T1"]
    assert report["after"]["alpha_T1"] > report["before"]["alpha_T1"]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_distill_parallel_adapts_the_draft_and_teaches_its_masks(tmp_path, tiny_tokenizer, patched_corpus):
    """`specdec distill --parallel`: the draft gets its mask row, the held-out acceptance of the root's row and
    of every mask rises, and the export drafts as a `ParallelDraft` (greedy output = plain decoding)."""
    from transformers import AutoTokenizer

    import specdec
    from specdec.training.distill import DistillConfig, distill
    from specdec.training.loop import LoopConfig

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    target, draft = _tiny_llama(len(tok), 32, 2, seed=0, init=0.3), _tiny_llama(len(tok), 32, 1, seed=1)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(str(tmp_path / name))
        tok.save_pretrained(str(tmp_path / name))
    cfg = DistillConfig(target=tmp_path / "target", draft=tmp_path / "draft", out=tmp_path / "out",
                        loop=LoopConfig(steps=25, lr=3e-2, warmup_steps=2, eval_every=1000, checkpoint_every=25),
                        batch_size=4, seq_len=32, eval_tokens=512, save_dtype="float32", parallel=True, max_gamma=4,
                        anchors=4)
    report = distill(cfg, log=lambda _msg: None)
    before, after = report["before"], report["after"]
    for j in range(4):  # the root's row and masks 1..3
        assert after[f"alpha_T1_{j}"] > before[f"alpha_T1_{j}"], j
    adapted = specdec.load(str(tmp_path / "out"))[0]
    assert adapted.get_input_embeddings().weight.shape[0] == len(tok) + 1
    prompt = tok.encode("def main():\n", add_special_tokens=False)
    out = specdec.generate(target, prompt, drafter=specdec.ParallelDraft(adapted), gamma=3, max_new_tokens=8)
    assert out.tokens == specdec.generate(target, prompt, max_new_tokens=8).tokens


# --------------------------------------------------------------------------- shipped default pair


def test_load_default_gives_finite_logits():
    from specdec.hub.default_pair import assets_present, load_default

    if not assets_present():
        pytest.skip("default model assets not built")
    target, draft, tok = load_default()
    assert target.config.vocab_size == draft.config.vocab_size == len(tok)
    assert not target.training and not draft.training
    assert next(target.parameters()).dtype == torch.float32
    ids = torch.tensor([tok.encode("import os\n\ndef main():\n", add_special_tokens=False)])
    with torch.no_grad():
        for model in (target, draft):
            logits = model(input_ids=ids).logits
            assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_load_default_missing_assets_raises(tmp_path):
    from specdec.hub.default_pair import load_default
    from specdec.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="missing"):
        load_default(root=tmp_path)


# --------------------------------------------------------------------------- the seq2seq pair's recipe


def test_seq2seq_pair_recipe_writes_the_shipped_bench_prompts(tmp_path, capsys):
    """`specdec train --recipe seq2seq-pair --heldout-prompts`: the held-out masked sources the shipped pair was
    benchmarked on, byte for byte (the recipe's tokenizer, chunking and masking unchanged)."""
    from specdec.cli import main

    out = tmp_path / "prompts.jsonl"
    assert main(["train", "--recipe", "seq2seq-pair", "--out", str(tmp_path / "run"), "--heldout-prompts", str(out),
                 "--num-prompts", "8"]) == 0
    shipped = Path(__file__).resolve().parents[1] / "docs/bench/cpu-seq2seq-trained/prompts.jsonl"
    rows = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert len(rows) == 8 and all("<mask>" in r for r in rows)
    if sys.version_info[:2] == (3, 11):  # the corpus is the running Python's stdlib: the shipped run's was 3.11
        assert out.read_bytes() == shipped.read_bytes()


def test_seq2seq_pair_recipe_saves_the_shipped_layout(tmp_path):
    """The recipe's checkpoints are the shipped layout: target/ and draft/ hold the models only, tokenizer/ their
    one tokenizer, and load_default_seq2seq loads the pair from it."""
    from specdec.hub.default_pair import SEQ2SEQ_REQUIRED, load_default_seq2seq
    from specdec.training.seq2seq_pair import load_tokenizer, make, save

    tokenizer = load_tokenizer()
    for name, seed in (("target", 0), ("draft", 1)):
        model = make(d_model=16, enc_layers=1, dec_layers=1, heads=2, d_ff=32, vocab=len(tokenizer), seed=seed,
                     arch="bart")
        save(model, tokenizer, tmp_path / name)
    assert all((tmp_path / rel).is_file() for rel in SEQ2SEQ_REQUIRED)
    assert not any((tmp_path / name / "tokenizer.json").exists() for name in ("target", "draft"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "target", "tokenizer"]  # no .tmp left over
    target, draft, loaded = load_default_seq2seq(root=tmp_path)
    assert loaded.mask_token == "<mask>" and len(loaded) == len(tokenizer) == target.config.vocab_size


def test_train_recipes_refuse_each_other_s_options(tmp_path, capsys):
    from specdec.cli import main

    assert main(["train", "--out", str(tmp_path), "--only", "target"]) == 2
    assert "--only: only for --recipe seq2seq-pair" in capsys.readouterr().err
    assert main(["train", "--recipe", "seq2seq-pair", "--out", str(tmp_path), "--model-size", "draft"]) == 2
    assert "--model-size: only for --recipe llama" in capsys.readouterr().err
    assert main(["train", "--recipe", "seq2seq-pair", "--out", str(tmp_path)]) == 2
    assert "give --only target or --only draft" in capsys.readouterr().err
