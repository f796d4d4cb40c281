"""Fixtures: a tiny GPT-2 with a 2048-token byte-level BPE saved to disk, a SentencePiece tokenizer trained offline,
padded data, the executed quickstart notebook, the session's pool of planned runs, and the models and data the launched
recipes train on (session-wide: the pool plans every module's runs from them before the first launch).

Shared helpers (launching, weights, comparisons) are in helpers.py; test modules import it, never each other.
"""

from __future__ import annotations

import inspect
import json
import os

import pytest
from helpers import (
    CLUSTER_ACCUM,
    CLUSTER_JOB,
    CLUSTER_MICRO,
    LAUNCH_LOG_ENV,
    QUICKSTART_LAUNCHES,
    RunPool,
    Runs,
    execute_quickstart,
    log_launches,
)

# The tiny models' tokenizer (bpe_2048), written by tests/scripts/write_bpe.py
BPE_2048 = os.path.join(os.path.dirname(__file__), "data", "bpe-2048", "tokenizer.json")


def pytest_configure(config):
    # The test process is not offline (tests/unit/test_hub.py tests the Hub's absence itself), so datasets'
    # load_dataset of a local json file sent the Hub a HEAD to count the download (datasets.load.increase_load_count):
    # without a network, one DNS wait of 5 s in the quick layer (seen in test_stream.py, in three different tests).
    # Its only effect is that count; set before datasets is imported (datasets.config reads it then).
    os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "0")
    if os.environ.get(LAUNCH_LOG_ENV):  # every subprocess's command and wall time, for tests/scripts/launch_log.py
        log_launches(os.environ[LAUNCH_LOG_ENV])


def pytest_collection_modifyitems(session, config, items):
    """tests/unit/ first (in their order), then tests/launch/: the in-process tests run on one core while the run
    pool's one-process batches run on the other (``_prefetch``)."""
    items.sort(key=lambda item: item.path.parent.name != "unit")
    # The quick layer (-m "not slow") is the in-process one: everything under tests/launch/ starts processes (a
    # command, a recipe, a launch), each paying an interpreter's imports of torch and transformers (2-5 s idle, 5x
    # that on a loaded machine), so the whole folder belongs to the slow layer.
    for item in items:
        if item.path.parent.name == "launch":
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The test process's torch on one thread, as every launched rank is (subprocess_env: OMP_NUM_THREADS=1). Its
    tiny models' ops are too small for a second thread to pay, and the other core is the prefetched launch's
    (``_prefetch``) or another process's: two OpenMP threads on one free core spin at each op's barrier, waiting for
    the descheduled one (tests/unit beside the prefetch, a full suite's start: 177.8 -> 115.0 s; the quick layer:
    86.9 -> 60.5 s). Set here, not through OMP_NUM_THREADS, so the subprocesses the tests start without
    subprocess_env keep their own."""
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session", autouse=True)
def _prefetch(request):
    """Before the session's first test: the run pool planned and its one-process batches launched in a thread
    (``RunPool.prefetch``), when a selected test uses the pool; at the end, that thread joined."""
    if not any("run_pool" in item.fixturenames for item in request.session.items):
        yield
        return
    thread = request.getfixturevalue("run_pool").prefetch()
    yield
    thread.join()


@pytest.fixture(scope="session")
def run_pool(request) -> RunPool:
    """Every planned run of the session (helpers.RunPool), planned before the first launch so that the runs of one
    launch config and world size share a launch whichever module asked for them. A test module that plans runs has a
    ``plan_runs(pool, <session fixtures>...)`` that returns its ``Runs`` by fixture name; it is called here for each
    module with a selected test that uses the pool (so ``-k`` on one module launches none of another's runs), and
    the module's fixture returns ``run_pool.modules[(module, fixture)]``."""
    pool = RunPool()
    modules = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if hasattr(module, "plan_runs") and module not in modules and "run_pool" in item.fixturenames:
            modules.append(module)
    for module in modules:
        names = list(inspect.signature(module.plan_runs).parameters)[1:]
        for fixture, runs in module.plan_runs(pool, **{n: request.getfixturevalue(n) for n in names}).items():
            pool.modules[(module.__name__, fixture)] = runs
    return pool


@pytest.fixture(scope="session")
def cluster_runs(tmp_path_factory, tiny_model, padded_data, run_pool) -> Runs:
    """Runs of helpers.CLUSTER_JOB, the job of the multi-machine and cluster tests."""
    return Runs(tmp_path_factory.mktemp("clusters"), tiny_model, padded_data, CLUSTER_JOB, pool=run_pool)


@pytest.fixture(scope="session")
def one_machine_run(cluster_runs) -> str:
    """CLUSTER_JOB on one machine, ``accelerate launch --num_processes 2`` under DDP: test_strategies.py's 2-rank DDP
    SGD run (the same fields: one run of the session's run_pool), tested equal to ZeRO-3 and one process there."""
    return cluster_runs.get("one-machine", "ddp.yaml", world=2, micro=CLUSTER_MICRO, accum=CLUSTER_ACCUM, extra={})


@pytest.fixture(scope="session")
def bpe_2048():
    """A byte-level BPE of 2048 tokens built like GPT-2's (toolkit.models.offline.pydoc_bpe_tokenizer): the tests' tiny models
    use it, since with GPT-2's 50257 tokens a 32-wide model's step is nearly all head and loss (docs/testing.md).
    Shipped as a file (BPE_2048), trained once on Python 3.11's pydoc text: every Python gets the same ids.
    tests/unit/test_offline.py tests the real GPT-2 tokenizer; the notebook and the README's run use it."""
    from toolkit.models.offline import bpe_from_file

    return bpe_from_file(BPE_2048)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, bpe_2048) -> str:
    """A 2-layer, 32-wide GPT-2 with a 2048-token byte-level BPE, saved and loaded back through from_pretrained."""
    from toolkit.models.offline import save_tiny_gpt2

    return save_tiny_gpt2(str(tmp_path_factory.mktemp("models") / "tiny-gpt2"), n_layer=2, n_embd=32, n_head=2,
                          n_positions=64, seed=0, tokenizer=bpe_2048)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, bpe_2048) -> str:
    """A 2-layer, 32-wide Llama (a family with a tensor-parallel plan) with the same 2048-token byte-level BPE."""
    from toolkit.models.offline import save_tiny_llama

    return save_tiny_llama(str(tmp_path_factory.mktemp("models") / "tiny-llama"), tokenizer=bpe_2048)


CHAT_MARKERS = ["<|system|>", "<|user|>", "<|assistant|>"]


@pytest.fixture(scope="session")
def sentencepiece_tokenizer(tmp_path_factory) -> str:
    """A folder holding a real SentencePiece tokenizer (BPE, byte fallback, Metaspace pre-tokenizer: the Llama 2 /
    Mistral kind) trained offline on CPython's pydoc text (vocabulary 2000, the chat markers as whole pieces) and
    converted to a fast Llama tokenizer; its ``tokenizer.json`` reloads without sentencepiece. About 0.2 s to train."""
    from pydoc_data.topics import topics

    import sentencepiece
    from transformers import LlamaTokenizer

    d = tmp_path_factory.mktemp("sentencepiece")
    (d / "text.txt").write_text("\n".join(topics[k] for k in sorted(topics)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(d / "text.txt"), model_prefix=str(d / "tokenizer"), vocab_size=2000, model_type="bpe",
        byte_fallback=True, user_defined_symbols=CHAT_MARKERS, normalization_rule_name="identity",
        remove_extra_whitespaces=False, num_threads=1, minloglevel=2)
    tok = LlamaTokenizer.from_pretrained(str(d))  # LlamaTokenizer(vocab_file=...) would build 3 tokens, silently
    assert len(tok) > 100 and tok.is_fast, (len(tok), type(tok))
    out = d / "converted"
    tok.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def padded_data(tmp_path_factory) -> dict:
    """jsonl train/validation rows of very different lengths (3 to ~60 tokens), cut from CPython's docs."""
    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)[:20]).split()
    rows, pos = [], 0
    for i in range(64):
        n = 2 + (i * 7) % 40  # lengths cycle through 2..41 words
        rows.append({"text": " ".join(words[pos : pos + n])})
        pos += n
    d = tmp_path_factory.mktemp("data")
    train, valid = d / "train.jsonl", d / "valid.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows[:48]) + "\n")
    valid.write_text("\n".join(json.dumps(r) for r in rows[48:]) + "\n")
    return {"train_file": str(train), "validation_file": str(valid)}


@pytest.fixture(scope="session")
def few_validation_rows(padded_data, tmp_path_factory) -> dict:
    """rows -> a validation file of padded_data's first 13 or 1 validation rows: sets that split unevenly over the
    data-parallel ranks (13 rows in eval batches of 2: 3 batches on one rank, 4 on the other) or leave a rank without
    a row of its own (1). One file per count for the session: runs of several modules on it are one run."""
    lines = open(padded_data["validation_file"]).read().splitlines()
    folder = tmp_path_factory.mktemp("few-validation-rows")
    files = {}
    for rows in (13, 1):
        files[rows] = str(folder / f"valid-{rows}.jsonl")
        with open(files[rows], "w") as f:
            f.write("\n".join(lines[:rows]) + "\n")
    return files


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory) -> dict:
    """notebooks/quickstart.ipynb executed once per session (~45 s), its notebook_launcher cell QUICKSTART_LAUNCHES
    times in a row; its two runs serve the notebook and report tests."""
    return execute_quickstart(tmp_path_factory.mktemp("quickstart"), launches=QUICKSTART_LAUNCHES)


# ---------------------------------------------------------------- the launched recipes' models and data
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="session")
def chats(tmp_path_factory):
    from toolkit.data.builtin import pydoc_chats

    raw = pydoc_chats()
    d = tmp_path_factory.mktemp("chats")
    for split, n, name in (("train", 32, "train.jsonl"), ("validation", 7, "valid.jsonl")):
        with open(d / name, "w") as f:
            for row in raw[split].select(range(n)):
                f.write(json.dumps({"messages": row["messages"]}) + "\n")
    (d / "template.jinja").write_text(TEMPLATE)
    return {"train_file": str(d / "train.jsonl"), "validation_file": str(d / "valid.jsonl"),
            "chat_template": str(d / "template.jinja")}


@pytest.fixture(scope="session")
def gpt2_256(tmp_path_factory, bpe_2048):
    """The tiny GPT-2 with 256 positions: rows long enough to hold several chats."""
    from toolkit.models.offline import save_tiny_gpt2

    return save_tiny_gpt2(str(tmp_path_factory.mktemp("models") / "tiny-gpt2-256"), n_layer=2, n_embd=32, n_head=2,
                          n_positions=256, seed=0, tokenizer=bpe_2048)


@pytest.fixture(scope="session")
def pairs(tmp_path_factory):
    """32 train and 7 held-out pairs of the built-in pydoc-preferences set (conversational), as jsonl files."""
    from toolkit.data.builtin import pydoc_preferences

    raw, d = pydoc_preferences(), tmp_path_factory.mktemp("pairs")
    for split, n, name in (("train", 32, "train.jsonl"), ("validation", 7, "valid.jsonl")):
        with open(d / name, "w") as f:
            for row in raw[split].select(range(n)):
                f.write(json.dumps(row) + "\n")
    (d / "template.jinja").write_text(TEMPLATE)
    return {"train_file": str(d / "train.jsonl"), "validation_file": str(d / "valid.jsonl"),
            "chat_template": str(d / "template.jinja")}


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory):
    from toolkit.models.offline import save_tiny_bert

    return save_tiny_bert(str(tmp_path_factory.mktemp("models") / "tiny-bert"))


@pytest.fixture(scope="session")
def classify_files(tmp_path_factory) -> dict:
    """jsonl train (48 rows) and validation (17 rows) files of the built-in stdlib-docstrings set, picked explicitly:
    its rows are sorted by class, so its first rows hold one class only, and the metrics of such rows cannot show a
    row counted twice, or in place of another. Here the six classes take turns, each round starting one class further
    on, so that rows one or two rounds apart hold different classes: a row counted in place of one a batch or two
    away (2 ranks x 3 rows: a round; accelerate pads the last batch with rows from the start) changes the classes
    counted."""
    from toolkit.data.builtin import stdlib_docstrings

    raw, d = stdlib_docstrings(), tmp_path_factory.mktemp("classify")
    names = raw["train"].features["label"].names
    files = {}
    for split, n in (("train", 48), ("validation", 17)):
        texts = [iter(r["text"] for r in raw[split] if r["label"] == c) for c in range(len(names))]
        classes = [(i + i // len(names)) % len(names) for i in range(n)]
        rows = [{"text": next(texts[c]), "label": names[c]} for c in classes]
        files[f"{split}_file"] = str(d / f"{split}.jsonl")
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


@pytest.fixture(scope="session")
def stored(tmp_path_factory, tiny_model):
    """The tiny model stored in bf16, and the very same values stored in fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("dtypes")
    bf16, fp32 = str(root / "bf16"), str(root / "fp32")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    AutoModelForCausalLM.from_pretrained(tiny_model).to(torch.bfloat16).save_pretrained(bf16)
    AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32).save_pretrained(fp32)
    for folder in (bf16, fp32):
        tokenizer.save_pretrained(folder)
    return {"bf16": bf16, "fp32": fp32}


@pytest.fixture(scope="session")
def text_shards(tmp_path_factory) -> dict:
    """A causal-LM corpus in 4 jsonl files of 25 paragraphs of CPython's docs each (1 to ~60 words): a stream."""
    from pydoc_data.topics import topics

    words = " ".join(topics[k] for k in sorted(topics)[20:40]).split()
    d, pos = tmp_path_factory.mktemp("text-shards"), 0
    for f in range(4):
        rows = []
        for i in range(25):
            n = 1 + (i * 11 + f * 5) % 60
            rows.append(json.dumps({"text": " ".join(words[pos:pos + n])}))
            pos += n
        (d / f"part-{f}.jsonl").write_text("\n".join(rows) + "\n")
    return {"train_file": str(d / "part-*.jsonl")}


@pytest.fixture(scope="session")
def chat_mixture(tmp_path_factory, chats) -> dict:
    """A dataset_mixture of two formats: 24 one-turn pydoc chats written as an Alpaca file (weight 0.75) and the
    32-chat ``messages`` file (weight 0.5), a tenth held out; the chats' template."""
    from toolkit.data.builtin import pydoc_chats

    d = tmp_path_factory.mktemp("chat-mixture")
    one_turn = [m for m in pydoc_chats()["train"]["messages"][32:] if len(m) == 2][:24]
    with open(d / "alpaca.jsonl", "w") as f:
        for user, assistant in one_turn:
            f.write(json.dumps({"instruction": user["content"], "input": "", "output": assistant["content"]}) + "\n")
    mixture = {"datasets": [{"id": str(d / "alpaca.jsonl"), "weight": 0.75},
                            {"id": chats["train_file"], "columns": ["messages"], "weight": 0.5}],
               "seed": 3, "test_split_size": 0.1}
    return {"dataset_mixture": json.dumps(mixture), "chat_template": chats["chat_template"]}


@pytest.fixture(scope="session")
def chat_shards(tmp_path_factory, chats):
    """The 32 training chats as a stream of 3 files (11, 11, 10 chats), the same template and held-out file."""
    d = tmp_path_factory.mktemp("chat-shards")
    lines = open(chats["train_file"]).read().splitlines(keepends=True)
    for i, start in enumerate((0, 11, 22)):
        (d / f"part-{i}.jsonl").write_text("".join(lines[start:start + 11]))
    return {**chats, "train_file": str(d / "part-*.jsonl")}
