"""The capability matrix's dimensions and values (issue 47), declared once: what a value of each dimension sets in a
run (its recipe, launch config, world size, fields, the launcher's environment), and the files and models the cells
train on. The covering array over them is covering.py's; the cells run in test_matrix.py.

Add a value when a capability lands: a name in DIMENSIONS and what it sets in ``_apply`` (or in one of the tables
below). The pairwise array then gives it a few cells with every other dimension's values; the pre-launch check
(``toolkit.cli.train.check``) decides which of them must be refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# dimension -> its values; the first is the *base* value (the plainest, accepted with every other base value): a
# refused cell is reduced towards it to find the pair (or triple) the refusal is about.
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "task": ("lm", "sft", "dpo", "classify", "grpo"),
    "layout": ("one", "ddp", "zero2", "zero3", "fsdp2", "fsdp1", "hsdp", "tp", "pp", "pp_fsdp2", "cp"),
    "adapter": ("none", "lora", "qlora4", "base8"),
    "data": ("padded", "bfd", "stream", "mixture", "stream_switch"),
    "arch": ("gpt2", "llama", "qwen2"),
    "split": ("even", "uneven", "one"),
    "precision": ("fp32", "bf16"),
    "ending": ("steps", "data_end", "sigterm", "merge", "resume_new_rank"),
    # the speed switches of issue 50: blocks compiled by aot_eager (bitwise eager), checkpoints written in the
    # background (a save every step), the loss without the micro-batch's logits (fused, chunks of LOSS_CHUNK positions)
    "speed": ("none", "aot_eager", "async_save", "loss_chunk"),
    "optim": ("sgd", "muon"),  # muon: issue 49's optimizer, with fp32 Newton-Schulz (OPTIMS)
}
# Dimensions added after the matrix's first runs: a cell's name holds their value only off its base, so that the
# names written before them (SUITE, docs/testing.md's tables) still name the same cells.
NAMED_OFF_BASE = ("speed", "optim")
SPEEDS = {"none": {}, "aot_eager": {"torch_compile": True, "torch_compile_backend": "aot_eager"},
          "async_save": {"async_save": True, "save_steps": 1},
          # chunks of 16 positions: a cell's micro-batch of 2-8 rows x up to 48 tokens takes several, so the chunking
          # (and ZeRO-3's one head call per micro-batch whatever its length) is exercised, not one chunk of all
          "loss_chunk": {"loss_chunk_size": 16}}

# The seams found by review (issue 47): partial cells the array starts from, so that each is a cell whatever the
# greedy choice would pick. (name, the values it fixes; the rest are filled in to cover pairs.)
SEAMS: tuple[tuple[str, dict], ...] = (
    ("pipeline x FSDP2, uneven validation split (hung after training)", {"layout": "pp_fsdp2", "split": "uneven"}),
    ("pipeline, one validation row", {"layout": "pp", "split": "one"}),
    ("QLoRA x GPT-2 (Conv1D) x merged export", {"adapter": "qlora4", "arch": "gpt2", "ending": "merge"}),
    ("GRPO x a chat model whose turns end with a token that is not EOS", {"task": "grpo", "arch": "qwen2"}),
    ("a stream whose files switch format", {"task": "sft", "data": "stream_switch"}),
    ("LoRA resumed with another rank and alpha", {"adapter": "lora", "ending": "resume_new_rank"}),
)

# layout -> (launch config, processes, micro batch, accumulation, fields): a global batch of 8 rows in each
LAYOUTS = {
    "one": ("ddp.yaml", 1, 8, 1, {}),
    "ddp": ("ddp.yaml", 2, 2, 2, {}),
    "zero2": ("zero2.yaml", 2, 2, 2, {}),
    "zero3": ("zero3.yaml", 2, 2, 2, {}),
    "fsdp2": ("fsdp.yaml", 2, 2, 2, {}),
    "fsdp1": ("fsdp1.yaml", 2, 2, 2, {}),
    "hsdp": ("hsdp.yaml", 4, 2, 1, {}),  # 2 replicas x 2 shards: a data-parallel degree of 4
    "tp": ("tp.yaml", 2, 8, 1, {}),  # both TP ranks take the same 8 rows
    "pp": ("ddp.yaml", 2, 2, 4, {"pipeline_parallel_size": 2}),  # 2 stages, one replica: 4 micro-batches of 2
    "pp_fsdp2": ("fsdp.yaml", 4, 2, 2, {"pipeline_parallel_size": 2}),  # 2 stages x 2 FSDP2 replicas
    "cp": ("ddp.yaml", 2, 4, 2, {"context_parallel_size": 2}),  # ring attention: one group of 2 shares every row
}
SPLITS = ("pipeline_parallel_size", "context_parallel_size")  # what one process cannot have (its reference drops them)
TASKS = {"lm": ("gpt2", "causal-lm"), "sft": ("sft", "chat-sft"), "dpo": ("dpo", "dpo"),
         "classify": ("classify", "sequence-classification"), "grpo": ("grpo", "grpo")}
# every cell: SGD (linear in the gradient: any normalisation or accumulation error shows), no clipping
COMMON = dict(optim="sgd", learning_rate=0.5, max_grad_norm=0, lr_scheduler_type="constant", weight_decay=0,
              seed=7, report_to="none", logging_steps=1, shuffle=True, per_device_eval_batch_size=2, block_size=48,
              save_steps=1000, plot=False)
# A classifier's loss is per example and its head trains whole: at COMMON's 0.5 its loss swung 1.8 -> 5.1 -> 2.8 ->
# 4.1 within 6 steps (Llama; Qwen2 with a 4-bit base alike), a chaotic path on which any rounding grows: bf16 DDP
# ended 2.69 from one bf16 process (the fp32 twin 1.31 from it), a ZeRO-2 fp32 adapter 2.9e-4 from one process. The
# promises compare runs, not a divergent run's noise: its cells train at a rate where the loss goes down.
TASK_FIELDS = {"classify": dict(learning_rate=0.05)}
# GRPO on Qwen2: a chat model whose turns end with <|im_end|>, a token its tokenizer does not call EOS (_chat_model)
GRPO_MODELS = {("grpo", "qwen2"): "qwen2_turns"}
STEPS = 3  # max_steps of a cell that ends by its steps (and of a merge export)
SIGTERM_AT = 1  # rank 0 is sent SIGTERM after this step: every rank ends the next one, saves it and stops
RESUMED_STEPS = 4  # an interrupted cell's max_steps: stopped at SIGTERM_AT + 1, resumed to here
LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear")
NEW_RANK = dict(lora_r=8, lora_alpha=16)  # resume_new_rank's relaunch: another rank and alpha
# optim muon at Keller Jordan's 0.02, its AdamW group (embeddings, head, norms, biases) at 3e-3 with eps 1e-6 (AdamW's
# equality setting: docs/pitfalls.md#adamw-eps); fp32 iterations, the only ones equal under every split
# (docs/pitfalls.md#muon-bf16). Its promise 1: the Muon group within the tolerance, the AdamW group within
# test_matrix.MUON_ADAMW_TOLERANCE.
OPTIMS = {"sgd": {}, "muon": dict(optim="muon", learning_rate=0.02, muon_adamw_learning_rate=3e-3,
                                  muon_ns_dtype="float32", adam_epsilon=1e-6)}
ADAPTERS = {"none": {}, "lora": LORA, "qlora4": {**LORA, "load_in_4bit": True}, "base8": {**LORA, "load_in_8bit": True}}
VALIDATION_ROWS = {"even": 8, "uneven": 9, "one": 1}  # 8 over 1, 2 or 4 ranks x 2 rows; 9 gives replicas
# different numbers of evaluation batches (5/4 rows on 2: 3 and 2 batches of 2; 3/2/2/2 on 4: 2 and 1)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# qwen2's chat model: turns end with <|im_end|>, a token its tokenizer does not call EOS (Qwen's, ChatML's)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# GRPO refuses the fields it has no use for (a held-out set's batch, block_size): COMMON's are unset for it
GRPO = dict(num_generations=4, max_completion_length=6, max_prompt_length=32, block_size=None,
            per_device_eval_batch_size=None, reward_funcs="grpo_rewards:vowels")


@dataclass(frozen=True)
class Cell:
    """One row of the covering array: a value of every dimension."""

    values: tuple[tuple[str, str], ...]  # (dimension, value) in DIMENSIONS' order
    seam: str | None = None

    @classmethod
    def of(cls, values: dict, seam: str | None = None) -> "Cell":
        return cls(tuple((d, values[d]) for d in DIMENSIONS), seam)

    @classmethod
    def from_name(cls, name: str) -> "Cell":
        """The cell ``name`` names (its values joined by '-', as ``name`` writes them), with its seam's name if the
        cell holds one's values."""
        parts, named = name.split("-"), [d for d in DIMENSIONS if d not in NAMED_OFF_BASE]
        values = dict(zip(named, parts))
        for value in parts[len(named):]:  # the later dimensions' values off their base, each in one dimension only
            values[next(d for d in NAMED_OFF_BASE if value in DIMENSIONS[d])] = value
        values.update({d: DIMENSIONS[d][0] for d in NAMED_OFF_BASE if d not in values})
        assert len(values) == len(DIMENSIONS) and all(v in DIMENSIONS[d] for d, v in values.items()), name
        seam = next((s for s, partial in SEAMS if all(values[d] == v for d, v in partial.items())), None)
        return cls.of(values, seam)

    def __getitem__(self, dim: str) -> str:
        return dict(self.values)[dim]

    @property
    def name(self) -> str:
        return "-".join(v for d, v in self.values if d not in NAMED_OFF_BASE or v != DIMENSIONS[d][0])


@dataclass
class Run:
    """What a cell launches: a recipe's fields under a launch config, and the launcher's environment beyond that
    config's (bf16: what ``accelerate launch --mixed_precision bf16`` adds)."""

    recipe: str
    task: str
    config: str
    world: int
    micro: int
    accum: int
    fields: dict
    env: dict = field(default_factory=dict)
    mixed_precision: str | None = None

    def argv(self, output_dir: str) -> list[str]:
        from helpers import args_from

        return args_from({**self.fields, "output_dir": output_dir, "per_device_train_batch_size": self.micro,
                          "gradient_accumulation_steps": self.accum})


def run_of(cell: Cell, files: dict) -> Run:
    """The run a cell launches (``files``: ``write_files``' paths)."""
    recipe, task = TASKS[cell["task"]]
    config, world, micro, accum, layout_fields = LAYOUTS[cell["layout"]]
    fields = {**COMMON, **TASK_FIELDS.get(cell["task"], {}), **layout_fields, **_data_fields(cell, files),
              **ADAPTERS[cell["adapter"]],
              "model_name_or_path": files["models"][GRPO_MODELS.get((cell["task"], cell["arch"]), cell["arch"])],
              **_ending_fields(cell), **SPEEDS[cell["speed"]],
              **OPTIMS[cell["optim"]]}
    if (cell["task"], cell["arch"]) == ("grpo", "qwen2"):  # its reward also logs where completions end (test_matrix)
        fields["reward_funcs"] = "grpo_rewards:vowels_ending_turns"
    if cell["arch"] == "qwen2" and cell["task"] in ("sft", "dpo", "grpo"):
        fields["chat_template"] = files["chatml"]
    bf16 = cell["precision"] == "bf16"
    from helpers import mixed_precision_env

    return Run(recipe, task, config, world, micro, accum, {k: v for k, v in fields.items() if v is not None},
               env=mixed_precision_env(config, world) if bf16 else {}, mixed_precision="bf16" if bf16 else None)


def reference_of(run: Run, precision: str | None = "same") -> Run:
    """The same global batch on one process (1 x 8 x 1), the same precision (or ``precision``: "bf16" or None for
    fp32): promise 1's other side."""
    # the plain run (SPEEDS' fields as COMMON has them): a speed switch must change nothing
    speed = {k for fields in SPEEDS.values() for k in fields}
    fields = {k: v for k, v in run.fields.items() if k not in SPLITS and k not in speed}
    fields.update({k: COMMON[k] for k in speed if k in COMMON})
    precision = run.mixed_precision if precision == "same" else precision
    env = {"ACCELERATE_MIXED_PRECISION": precision} if precision else {}
    return Run(run.recipe, run.task, "ddp.yaml", 1, 8, 1, fields, env, precision)


def _ending_fields(cell: Cell) -> dict:
    ending = cell["ending"]
    if ending == "data_end":  # the data runs out: a map-style set after one epoch, a stream before its max_steps
        return {"max_steps": 1000} if cell["data"].startswith("stream") else {"max_steps": -1, "num_train_epochs": 1}
    if ending in ("sigterm", "resume_new_rank"):
        return {"max_steps": RESUMED_STEPS}
    return {"max_steps": STEPS, "merge_lora": True if ending == "merge" else None}


def _data_fields(cell: Cell, files: dict) -> dict:
    task, data, rows = cell["task"], cell["data"], VALIDATION_ROWS[cell["split"]]
    own = files[task]
    if task == "grpo":  # GRPO has no held-out evaluation (refused): the split does not apply to it
        rows = None
    if data == "mixture":  # two formats mixed (dataset_mixture replaces the files; its test split is the held-out)
        mixture = json.loads(own["mixture"])
        if rows:  # datasets holds out ceil(size x rows): exactly ``rows`` of them
            mixture["test_split_size"] = (rows - 0.5) / own["mixture_rows"]
        return {"dataset_mixture": json.dumps(mixture), "packing": False, **own["extra"]}
    out = {"train_file": own[data] if data.startswith("stream") else own["train"],
           "validation_file": own[f"valid_{rows}"] if rows else None, **own["extra"]}
    if data.startswith("stream"):  # a small shuffle window (a field of the tasks that stream: lm, sft)
        out.update(streaming=True, packing=True, **({"shuffle_buffer_size": 12} if task in ("lm", "sft") else {}))
    else:
        out["packing"] = data == "bfd"
        if data == "bfd":
            out["packing_strategy"] = "bfd"
    return out


# ------------------------------------------------------------------ the models and files the cells train on
def _jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _splits(d, own: dict, valid: list) -> None:
    for n in set(VALIDATION_ROWS.values()):
        own[f"valid_{n}"] = _jsonl(d / f"valid-{n}.jsonl", valid[:n])


def write_models(root, bpe) -> dict:
    """The three architectures, 2 layers and 32 wide each, on the tests' 2048-token BPE (tests/conftest.py's
    ``bpe_2048``): GPT-2 (Conv1D, tied head), Llama (untied), Qwen2 with a sliding window of 8 in both layers and
    ChatML turns that end with <|im_end|>, a token its tokenizer does not call EOS."""
    import copy

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from toolkit.models.offline import save_tiny_gpt2, save_tiny_llama

    models = {"gpt2": save_tiny_gpt2(str(root / "gpt2"), n_layer=2, n_embd=32, n_head=2, n_positions=64, seed=0,
                                     tokenizer=bpe),
              "llama": save_tiny_llama(str(root / "llama"), tokenizer=bpe)}
    tok = copy.deepcopy(bpe)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_sliding_window=True, sliding_window=8, max_window_layers=0, tie_word_embeddings=False,
                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    models["qwen2"] = str(root / "qwen2")
    model.save_pretrained(models["qwen2"])
    tok.model_max_length = 64
    tok.save_pretrained(models["qwen2"])
    models["qwen2_turns"] = _chat_model(model, tok, str(root / "qwen2-turns"))
    return models


def _chat_model(model, tok, path: str) -> str:
    """GRPO's Qwen2 (``GRPO_MODELS``): a chat model as Qwen's instruct releases are, whose generation_config ends
    generation at ``<|im_end|>`` as well as at the tokenizer's EOS, and which ends about half its 6-token completions
    there (measured: 34 of 64 draws from the whole distribution, as GRPO samples, 32 before their last token; its
    first token 10% ``<|im_end|>``): every embedding shares one direction, which ``<|im_end|>``'s row of the (untied)
    head reads. Without that, a random model drew ``<|im_end|>`` about once in 2000 tokens and generating past a
    turn's end showed in no cell."""
    import torch

    end = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        shared = torch.randn(model.config.hidden_size)
        shared /= shared.norm()
        model.model.embed_tokens.weight += 0.2 * shared
        model.lm_head.weight[end] = 1.25 * shared
    model.generation_config.eos_token_id = [end, tok.eos_token_id]
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_files(root, bpe, tasks=DIMENSIONS["task"]) -> dict:
    """The cells' models and data under ``root`` (a pathlib folder): per task of ``tasks`` its training file, two
    streams of files, a mixture of two formats, and validation files of 8, 9 and 1 rows."""
    from transformers import AutoTokenizer

    files = {"models": write_models(root / "models", bpe)}
    (root / "chatml.jinja").write_text(CHATML)
    (root / "template.jinja").write_text(CHAT_TEMPLATE)
    files["chatml"] = str(root / "chatml.jinja")
    template = {"chat_template": str(root / "template.jinja")}
    end_of_turn = AutoTokenizer.from_pretrained(files["models"]["qwen2"]).convert_tokens_to_ids("<|im_end|>")
    for task in tasks:
        files[task] = WRITERS[task](root / task, template, **({"end_of_turn": end_of_turn} if task == "grpo" else {}))
    return files


def _lm_files(d, template: dict) -> dict:
    from pydoc_data.topics import topics

    words, rows, pos = " ".join(topics[k] for k in sorted(topics)[:30]).split(), [], 0
    for i in range(88):  # lengths cycle through 2..41 words, as tests/conftest.py's padded_data
        n = 2 + (i * 7) % 40
        rows.append({"text": " ".join(words[pos:pos + n])})
        pos += n
    titled = [{"title": f"row {i}", "body": r["text"]} for i, r in enumerate(rows[56:])]  # another column
    own = _task_files(d, rows[:48], rows[47:56], titled, {})
    with open(d / "mix.txt", "w") as f:  # the mixture's second format: a text file, a document a line
        f.write("".join(r["text"] + "\n" for r in rows[56:88]))
    return _mixture(own, [d / "mixture-a.jsonl", d / "mix.txt"], 80)


def _sft_files(d, template: dict) -> dict:
    from toolkit.data.builtin import pydoc_chats

    chats = pydoc_chats()
    messages = [{"messages": m} for m in chats["train"]["messages"][:32]]
    one_turn = [m for m in chats["train"]["messages"][32:] if len(m) == 2][:24]
    alpaca = [{"instruction": u["content"], "input": "", "output": a["content"]} for u, a in one_turn]
    valid = [{"messages": m} for m in chats["validation"]["messages"][:9]]
    own = _task_files(d, messages, valid, alpaca, template)
    return _mixture(own, [d / "mixture-a.jsonl", d / "mixture-b.jsonl"], 56)


def _dpo_files(d, template: dict) -> dict:
    from toolkit.data.builtin import pydoc_preferences

    prefs = pydoc_preferences()
    pairs = [dict(r) for r in prefs["train"].select(range(56))]
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in pairs[32:]]
    own = _task_files(d, pairs[:32], [dict(r) for r in prefs["validation"].select(range(9))], implicit, template)
    return _mixture(own, [d / "mixture-a.jsonl", d / "mixture-b.jsonl"], 56)


def _classify_files(d, template: dict) -> dict:
    from toolkit.data.builtin import stdlib_docstrings

    docs = stdlib_docstrings()
    names = docs["train"].features["label"].names
    labelled = [{"text": r["text"], "label": names[r["label"]]} for r in docs["train"].shuffle(seed=0).select(range(72))]
    valid = [{"text": r["text"], "label": names[r["label"]]} for r in docs["validation"].shuffle(seed=0).select(range(9))]
    ids = [{"text": r["text"], "label": names.index(r["label"])} for r in labelled[48:]]  # class ids, not names
    own = _task_files(d, labelled[:48], valid, ids, {})
    return _mixture(own, [d / "mixture-a.jsonl", d / "mixture-b.jsonl"], 72)


def _grpo_files(d, template: dict, end_of_turn: int) -> dict:
    """``end_of_turn``: a column of Qwen2's <|im_end|> id, for the reward that logs where completions end."""
    prompts = [(a, b) for a in range(2, 12) for b in range(3, 9)][:64]
    as_chat = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": a + b,
                "end_of_turn": end_of_turn} for a, b in prompts]
    as_text = [{"prompt": f"What is {a} + {b}?", "answer": a + b, "end_of_turn": end_of_turn}
               for a, b in prompts[48:]]  # TRL's text prompts
    own = _task_files(d, as_chat[:48], as_chat[55:64], as_text, {**template, **GRPO})
    return _mixture(own, [d / "mixture-a.jsonl", d / "mixture-b.jsonl"], 64)


WRITERS = {"lm": _lm_files, "sft": _sft_files, "dpo": _dpo_files, "classify": _classify_files, "grpo": _grpo_files}


def _task_files(d, train: list, valid: list, other: list, extra: dict) -> dict:
    """A task's files: ``train``; two streams (the training rows in 3 files; in stream_switch the middle one's second
    half holds ``other``, rows of another format: the format-switch seam); the mixture's two sets (``train`` in its
    format, ``other`` in another); validation files of 8, 9 and 1 rows from ``valid``."""
    d.mkdir(parents=True, exist_ok=True)
    own = {"train": _jsonl(d / "train.jsonl", train), "extra": extra}
    thirds = [train[: len(train) // 3], train[len(train) // 3: 2 * len(train) // 3], train[2 * len(train) // 3:]]
    # stream_switch: the middle file switches format half-way (issue 46 item 10: the rows after the switch were
    # dropped silently); a switch between files is refused by datasets' reader (a CastError, in the check)
    half = len(thirds[1]) // 2
    for name, middle in (("stream", thirds[1]), ("stream_switch", thirds[1][:half] + other[: len(thirds[1]) - half])):
        (d / name).mkdir()
        for i, part in enumerate((thirds[0], middle, thirds[2])):
            _jsonl(d / name / f"part-{i}.jsonl", part)
        own[name] = str(d / name / "part-*.jsonl")
    _jsonl(d / "mixture-a.jsonl", train)
    _jsonl(d / "mixture-b.jsonl", other)
    _splits(d, own, valid)
    return own


def _mixture(own: dict, paths: list, rows: int) -> dict:
    own["mixture"] = json.dumps({"datasets": [{"id": str(p), "weight": 1.0} for p in paths], "seed": 3})
    own["mixture_rows"] = rows
    return own
