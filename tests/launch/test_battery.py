"""A battery of bad inputs through the real recipe: each stops with exit code 2 and one message naming the field and
the fix, before the weights load, and leaves an existing run's output_dir exactly as it was.

Every case points at the same finished run (``existing``: metrics, config, checkpoints, final/) and is hashed before
and after, so a check that let a case through to training would show as changed files. ``overwrite_output_dir``
is on unless the case is about it, so that only the case's own mistake can stop the run. The cases run in one
process (tests/scripts/battery.py: the recipe's own ``main`` under its own ``cli``), one after another.
"""

import json
import os
import sys

import pytest
import yaml
from helpers import RECIPE, SCRIPTS, Runs, args_from, run, tree_hash

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"

BASE = dict(packing=False, block_size=32, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
            save_steps=1, logging_steps=1, seed=7, report_to="none", optim="sgd", learning_rate=0.1)
EXISTING_COMMON = {k: v for k, v in BASE.items() if k not in ("per_device_train_batch_size",
                                                              "gradient_accumulation_steps")}


def plan_runs(pool, tmp_path_factory, tiny_model, padded_data):
    """The finished run every case points at, planned (conftest's run_pool): it joins the session's one-process
    launch, run beside tests/unit."""
    runs = Runs(tmp_path_factory.mktemp("battery"), tiny_model, padded_data, EXISTING_COMMON, pool=pool)
    runs.plan("existing", None, 1, 2, 2, {}, probe=False)
    return {"existing_runs": runs}


@pytest.fixture(scope="module")
def existing(run_pool):
    """A finished 2-step run (1 process x 2 x 2) whose folder every case points at."""
    out = run_pool.modules[(__name__, "existing_runs")].get("existing", None, 1, 2, 2, {})
    assert os.path.isfile(os.path.join(out, "checkpoints", "step-2", "toolkit_state.json"))
    return out


def _files(tmp_path_factory, padded_data) -> dict:
    d = tmp_path_factory.mktemp("battery_files")
    rows = [json.loads(line) for line in open(padded_data["train_file"])]
    paths = {}

    def write(name, text):
        paths[name] = str(d / name)
        with open(paths[name], "w") as f:
            f.write(text)

    write("int_text.jsonl", "".join(json.dumps({"text": i}) + "\n" for i in range(48)))
    write("empty.jsonl", "")
    write("data.xml", "<rows/>")
    write("tiny_valid.jsonl", json.dumps({"text": "a few words"}) + "\n")
    write("other_train.jsonl", "".join(json.dumps({"text": r["text"] + " more"}) + "\n" for r in rows))
    write("a_file", "not a folder")
    write("config.yaml", "learning_rate: 1e-3\n")
    write("bad.yaml", "learning_rate: [1e-3\n")
    # DPO pairs (recipes/dpo.py): one without its rejected column, one with an empty completion
    pair = {"prompt": "The sky is", "chosen": " blue", "rejected": " green"}
    write("pairs_no_rejected.jsonl", "".join(json.dumps({"prompt": pair["prompt"], "chosen": pair["chosen"]}) + "\n"
                                             for _ in range(8)))
    write("pairs_empty_chosen.jsonl", "".join(json.dumps({**pair, "chosen": "" if i == 3 else pair["chosen"]}) + "\n"
                                              for i in range(8)))
    write("pairs.jsonl", "".join(json.dumps(pair) + "\n" for _ in range(8)))
    long = {**pair, "prompt": " ".join(["The sky over the hills"] * 10)}  # 90 tokens: more than block_size 32
    write("pairs_long_prompt.jsonl", "".join(json.dumps(long if i == 5 else pair) + "\n" for i in range(8)))
    # other formats (recipes/sft.py): an Alpaca row without its output, a ShareGPT speaker with no role
    write("alpaca_null_output.jsonl", "".join(json.dumps({"instruction": "Say hi.", "output": None if i == 2 else "Hi"})
                                              + "\n" for i in range(8)))
    write("sharegpt_bot.jsonl", "".join(json.dumps({"conversations": [{"from": "human", "value": "Hi"},
                                                                       {"from": "bot", "value": "Hello"}]}) + "\n"
                                        for _ in range(8)))
    os.makedirs(d / "another_run")  # the metrics of another run that a resume must not write into
    write("another_run/metrics.jsonl", json.dumps({"step": 1, "loss": 1.0}) + "\n")
    return paths


def _missing_tracker() -> str:
    """A tracker of accelerate's whose package this environment lacks (wandb here)."""
    import importlib.util

    from toolkit.config import TRACKERS

    return next(name for name, modules in TRACKERS.items() if not any(importlib.util.find_spec(m) for m in modules))


def _field_cases() -> list[tuple]:
    """The cases of one field's value: unknown, wrong type, impossible (in the shape of ``_cases``)."""
    return [
        # --- fields: unknown, wrong type, impossible value
        ("typo", {"learning_rat": 1e-3}, [], {}, "learning_rat", "Did you mean 'learning_rate'"),
        ("cli typo", {}, ["--per_device_train_batch_sise", "4"], {}, "per_device_train_batch_sise", "Did you mean"),
        ("train-side typo", {}, ["--per_device_batch_size", "4"], {}, "per_device_batch_size",
         "Did you mean 'per_device_train_batch_size'"),
        ("every typo at once", {"learning_rat": 1e-3}, ["--warmup_step", "1"], {}, "learning_rat, warmup_step",
         "2 unknown fields"),
        ("unset on the command line", {}, ["--train_file", "null"], {}, "dataset_name", "set dataset_name"),
        ("not a float", {"learning_rate": "fast"}, [], {}, "learning_rate", "invalid float"),
        ("not an int", {"gradient_accumulation_steps": 2.5}, [], {}, "gradient_accumulation_steps", "invalid int"),
        ("zero batch", {"per_device_train_batch_size": 0}, [], {}, "per_device_train_batch_size", "positive"),
        ("zero eval batch", {"per_device_eval_batch_size": 0}, [], {}, "per_device_eval_batch_size", "positive"),
        ("negative lr", {"learning_rate": -1}, [], {}, "learning_rate", ">= 0"),
        ("negative clip", {"max_grad_norm": -1}, [], {}, "max_grad_norm", "0 turns clipping off"),
        ("negative decay", {"weight_decay": -0.1}, [], {}, "weight_decay", ">= 0"),
        # NaN passes every comparison (nan < 0 is False): a NaN max_grad_norm silently made the weights NaN
        ("NaN lr", {"learning_rate": float("nan")}, [], {}, "learning_rate", "must be a finite number, got nan"),
        ("infinite lr", {"learning_rate": float("inf")}, [], {}, "learning_rate", "must be a finite number"),
        ("NaN clip", {"max_grad_norm": float("nan")}, [], {}, "max_grad_norm", "must be a finite number"),
        ("infinite clip", {"max_grad_norm": float("inf")}, [], {}, "max_grad_norm", "must be a finite number"),
        ("NaN decay", {"weight_decay": float("nan")}, [], {}, "weight_decay", "must be a finite number"),
        ("infinite decay", {"weight_decay": float("inf")}, [], {}, "weight_decay", "must be a finite number"),
        ("beta1 of 1", {"adam_beta1": 1.0}, [], {}, "adam_beta1", "must be in [0, 1)"),
        ("beta2 of 1", {"adam_beta2": 1.0}, [], {}, "adam_beta2", "must be in [0, 1)"),
        ("zero overflow limit", {"max_consecutive_overflows": 0}, [], {}, "max_consecutive_overflows", "positive"),
        ("negative warmup", {"warmup_steps": -1}, [], {}, "warmup_steps", ">= 0"),
        ("zero steps", {"max_steps": 0}, [], {}, "max_steps", "positive"),
        ("zero epochs", {"max_steps": -1, "num_train_epochs": 0}, [], {}, "num_train_epochs", "> 0"),
        ("zero logging", {"logging_steps": 0}, [], {}, "logging_steps", "positive"),
        ("zero eval steps", {"eval_steps": 0}, [], {}, "eval_steps", "positive"),
        ("zero save limit", {"save_total_limit": 0}, [], {}, "save_total_limit", "positive"),
        ("negative workers", {"dataloader_num_workers": -1}, [], {}, "dataloader_num_workers", ">= 0"),
        ("negative loss chunk", {"loss_chunk_size": -1}, [], {}, "loss_chunk_size", ">= 0 (0 turns it off)"),
        ("zero peak flops", {"peak_flops": 0}, [], {}, "peak_flops", "must be a device's peak FLOP/s"),
        ("unknown optim", {"optim": "adamw"}, [], {}, "optim", "choose one of"),
        ("unknown scheduler", {"lr_scheduler_type": "cosin"}, [], {}, "lr_scheduler_type", "Did you mean 'cosine'"),
        ("unknown normalisation", {"loss_normalization": "mean"}, [], {}, "loss_normalization", "choose one of"),
        ("unknown dtype", {"torch_dtype": "fp8"}, [], {}, "torch_dtype", "choose one of"),
        ("split 100%", {"validation_split_percentage": 100}, [], {}, "validation_split_percentage", "[0, 100)"),
        ("zero block", {"block_size": 0}, [], {}, "block_size", "positive"),
        ("block over positions", {"block_size": 4096}, [], {}, "block_size", "exceeds the model's 64 positions"),
        ("unknown packing strategy", {"packing_strategy": "ffd"}, [], {}, "packing_strategy",
         "'ffd' is not one of wrapped, bfd"),
        ("packing strategy without packing", {"packing_strategy": "bfd"}, [], {}, "packing_strategy",
         "applies only with packing: true"),
    ]


def _cases(existing, tiny_model, padded_data, files) -> list[tuple]:
    """(name, changes to the good base config, extra argv, env, field named, words in the message[, recipe])."""
    ckpt = os.path.join(existing, "checkpoints", "step-1")
    resume = {"resume_from_checkpoint": ckpt}
    from transformers import AutoTokenizer

    long_prompt = json.loads(open(files["pairs_long_prompt.jsonl"]).read().splitlines()[5])["prompt"]
    # the tiny model's tokenizer (the shipped BPE, conftest's bpe_2048): 90 tokens
    long_tokens = len(AutoTokenizer.from_pretrained(tiny_model)(long_prompt)["input_ids"])
    train, no_files = padded_data["train_file"], {"train_file": None, "validation_file": None}
    return _field_cases() + [
        # --- YAML nulls: an unset value is not a value for these
        ("null seed", {"seed": None}, [], {}, "seed", "is empty (null)"),
        ("null shuffle", {"shuffle": None}, [], {}, "shuffle", "is empty (null)"),
        ("null learning rate", {"learning_rate": None}, [], {}, "learning_rate", "is empty (null)"),
        ("null max steps", {"max_steps": None}, [], {}, "max_steps", "is empty (null)"),
        # --- the config file itself
        ("missing config file", None, ["--config", "/nonexistent/c.yaml"], {}, "config", "file not found"),
        ("config not YAML", None, ["--config", files["bad.yaml"]], {}, "config", "not valid YAML"),
        # --- model
        ("no model", {"model_name_or_path": None}, [], {}, "model_name_or_path", "set model_name_or_path"),
        ("model folder missing", {"model_name_or_path": "./no/such/model"}, [], {}, "model_name_or_path",
         "folder not found"),
        # (the Hub's 404 where it answers, else its unreachability: both at once since toolkit/env/hub.py)
        ("unreachable Hub model", {"model_name_or_path": "some-org/not-a-model"}, [], {}, "model_name_or_path",
         "cannot load 'some-org/not-a-model': not a local folder, and the Hub "),
        ("Hub dataset offline", {"dataset_name": "some-org/not-a-set", "train_file": None, "validation_file": None},
         [], {"HF_HUB_OFFLINE": "1"}, "dataset_name",
         "not a local folder, and the Hub is unreachable (HF_HUB_OFFLINE is set) with no copy of 'some-org/not-a-set'"),
        ("override without =", {"config_overrides": "n_layer"}, [], {}, "config_overrides", "key=value"),
        ("override unknown key value", {"config_overrides": "n_layer=abc"}, [], {}, "config_overrides",
         "cannot read the model config"),
        # --- data
        ("no data", {"train_file": None, "validation_file": None}, [], {}, "dataset_name", "set dataset_name"),
        ("data twice", {"dataset_name": "pydoc"}, [], {}, "train_file", "not both"),
        ("train file missing", {"train_file": "/nonexistent/train.jsonl"}, [], {}, "train_file", "not found"),
        ("validation file missing", {"validation_file": "/nonexistent/v.jsonl"}, [], {}, "validation_file",
         "not found"),
        ("unsupported format", {"train_file": files["data.xml"], "validation_file": None}, [], {}, "train_file",
         "unsupported extension"),
        ("empty file", {"train_file": files["empty.jsonl"]}, [], {}, "train_file", "file is empty"),
        ("missing text column", {"text_column_name": "body"}, [], {}, "text_column_name", "'body' not in"),
        ("integer texts", {"train_file": files["int_text.jsonl"], "validation_file": None}, [], {},
         "text_column_name", "not text"),
        ("validation packs to nothing", {"validation_file": files["tiny_valid.jsonl"], "packing": True,
                                         "eval_steps": 1}, [], {}, "block_size",
         "the validation split has no rows after tokenization"),
        ("batch bigger than data", {"per_device_train_batch_size": 40}, [], {}, "per_device_train_batch_size",
         "fewer than one global batch"),
        ("glob matching nothing", {"train_file": os.path.join(os.path.dirname(files["a_file"]), "part-*.jsonl")}, [],
         {}, "train_file", "matches no file"),
        # --- streams (streaming: true)
        ("stream without max_steps", {"streaming": True, "max_steps": -1}, [], {}, "max_steps",
         "a stream has no length"),
        ("stream with wrapped packing", {"streaming": True, "packing": True, "packing_strategy": "wrapped"}, [], {},
         "packing_strategy", "wrapped packing mixes neighbouring documents"),
        ("stream with max_train_samples", {"streaming": True, "max_train_samples": 8}, [], {}, "max_train_samples",
         "bound a stream with max_steps"),
        # --- output_dir
        ("finished run", {"overwrite_output_dir": False}, [], {}, "output_dir", "already holds a finished run"),
        ("output_dir is a file", {"output_dir": files["a_file"]}, [], {}, "output_dir", "is a file"),
        # --- trackers: accelerate only logs at debug level and trains without one whose package is missing
        ("tracker not installed", {"report_to": _missing_tracker()}, [], {}, "report_to", "is not installed"),
        ("unknown tracker", {"report_to": "tensorbord"}, [], {}, "report_to", "Did you mean 'tensorboard'"),
        # --- precision
        ("fp16 on CPU", {}, [], {"ACCELERATE_MIXED_PRECISION": "fp16"}, "mixed_precision", "fp16 needs a GPU"),
        # --- a cluster scheduler's machines, one process each (issue 29): each would train alone
        ("Kubernetes pods, no launcher", {}, [], {"PET_NNODES": "2", "PET_NODE_RANK": "1"}, "num_machines",
         "PET_NNODES=2 says 2 machines"),
        ("SLURM nodes, no launcher", {}, [], {"SLURM_STEP_NUM_NODES": "2"}, "num_machines",
         "SLURM_STEP_NUM_NODES=2 says 2 machines"),
        # --- the launch config
        ("skip nonfinite under DeepSpeed", {"skip_nonfinite_steps": True}, [], {"ACCELERATE_USE_DEEPSPEED": "true"},
         "skip_nonfinite_steps", "cannot be honoured under DeepSpeed"),
        # --- resume
        ("resume from missing folder", {"resume_from_checkpoint": "/nonexistent/ckpt"}, [], {},
         "resume_from_checkpoint", "folder not found"),
        ("resume from the model folder", {"resume_from_checkpoint": tiny_model}, [], {}, "resume_from_checkpoint",
         "is not a checkpoint of this toolkit"),
        ("resume latest with none", {"resume_from_checkpoint": "latest", "output_dir": os.path.dirname(ckpt)}, [],
         {}, "resume_from_checkpoint", "holds no checkpoint"),
        ("resume into another run's folder", {**resume, "output_dir": os.path.dirname(files["another_run/metrics.jsonl"]),
                                              "overwrite_output_dir": False, "trust_checkpoint": True}, [], {},
         "resume_from_checkpoint", "is not a checkpoint of output_dir"),
        ("resume another run's checkpoint untrusted", {**resume, "output_dir": os.path.join(
            os.path.dirname(files["a_file"]), "fresh")}, [], {}, "resume_from_checkpoint",
         "so a checkpoint folder is code: if you trust it (your own run's), set trust_checkpoint: true"),
        ("resume with another seed", {**resume, "seed": 8}, [], {}, "seed", "seed was 7, now 8"),
        ("resume with shuffle off", {**resume, "shuffle": False}, [], {}, "shuffle", "shuffle was True, now False"),
        ("resume with packing", {**resume, "packing": True}, [], {}, "packing", "packing was False, now True"),
        ("resume with another block size", {**resume, "block_size": 24}, [], {}, "block_size", "block_size was 32"),
        ("resume with other data", {**resume, "train_file": files["other_train.jsonl"]}, [], {}, "train_file",
         "the training data changed"),
        # --- DPO (recipes/dpo.py: the last element names the recipe)
        ("dpo without a rejected column", {"train_file": files["pairs_no_rejected.jsonl"], "validation_file": None},
         [], {}, "dataset_format", "has the columns ['prompt', 'chosen'], which fit none of the formats this recipe "
         "takes: preference (prompt, chosen, rejected); implicit_preference (chosen, rejected)", "dpo"),
        ("dpo empty completion", {"train_file": files["pairs_empty_chosen.jsonl"], "validation_file": None}, [], {},
         "train_file", "row 3, chosen: the completion is empty", "dpo"),
        ("dpo on a stream", {"train_file": files["pairs_empty_chosen.jsonl"], "validation_file": None,
                             "streaming": True}, [], {}, "streaming", "the dpo task cannot train on a stream", "dpo"),
        # a field of another recipe's task: gpt2.py refuses DPO's beta, dpo.py a classifier's label column
        ("another recipe's field", {"beta": 0.2}, [], {}, "beta",
         "is a field of recipes/dpo.py, recipes/grpo.py; recipes/gpt2.py does not use it"),
        ("another recipe's field in dpo", {"train_file": files["pairs.jsonl"], "validation_file": None,
                                           "label_column_name": "topic"}, [], {}, "label_column_name",
         "is a field of recipes/classify.py; recipes/dpo.py does not use it", "dpo"),
        ("dpo beta zero", {"train_file": files["pairs_empty_chosen.jsonl"], "validation_file": None, "beta": 0}, [], {},
         "beta", "must be > 0", "dpo"),
        # by default the pair is dropped (TRL's rule) and the run trains; drop_long_prompts: false refuses it
        ("dpo prompt longer than block_size", {"train_file": files["pairs_long_prompt.jsonl"], "validation_file": None,
                                               "drop_long_prompts": False}, [], {}, "block_size",
         f"row 5: the prompt is {long_tokens} tokens, so block_size 32 leaves its chosen completion no token; raise "
         "block_size, remove the pairs with longer prompts, or set drop_long_prompts: true", "dpo"),
        ("dpo from a config", {"train_file": files["pairs.jsonl"], "validation_file": None,
                               "model_name_or_path": None, "config_name": tiny_model}, [], {}, "model_name_or_path",
         "DPO's reference is the starting weights", "dpo"),
        ("dpo live reference under FSDP1", {"train_file": files["pairs.jsonl"], "validation_file": None},
         [], {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "precompute_ref_log_probs",
         "a live reference copy is not sharded under FSDP1 here; set precompute_ref_log_probs: true", "dpo"),
        # --- dataset formats and mixtures (recipes/sft.py where the format is a chat one)
        ("unknown dataset format", {"dataset_format": "chatml"}, [], {}, "dataset_format", "'chatml' is not one of"),
        ("text columns for chat SFT", {"chat_template": CHAT_TEMPLATE}, [], {}, "dataset_format",
         "has the columns ['text'], which fit none of the formats this recipe takes: messages (messages)", "sft"),
        ("alpaca row without output", {"train_file": files["alpaca_null_output.jsonl"], "validation_file": None,
                                       "chat_template": CHAT_TEMPLATE}, [], {}, "dataset_format",
         "the train split, row 2: column 'output' holds NoneType", "sft"),
        ("sharegpt speaker without a role", {"train_file": files["sharegpt_bot.jsonl"], "validation_file": None,
                                             "chat_template": CHAT_TEMPLATE}, [], {}, "sharegpt_roles",
         "row 0: the speaker 'bot' has no role; map it", "sft"),
        ("mixture weight above 1", {**no_files, "dataset_mixture": {"datasets": [{"id": train, "weight": 1.5}]}}, [],
         {}, "dataset_mixture", "weight is the fraction of the set's rows to take, in (0, 1]; got 1.5"),
        ("mixture file missing", {**no_files, "dataset_mixture": {"datasets": [{"id": "/nonexistent/m.jsonl"}]}}, [],
         {}, "dataset_mixture", "datasets[0]: no file matches '/nonexistent/m.jsonl'"),
        ("mixture beside train_file", {"dataset_mixture": {"datasets": [{"id": train}]}}, [], {}, "dataset_mixture",
         "replaces dataset_name, train_file and validation_file; unset train_file, validation_file"),
        ("mixture column missing", {**no_files, "dataset_mixture": {"datasets": [{"id": train, "columns": ["body"]}]}},
         [], {}, "dataset_mixture", "no column(s) ['body']; it has ['text']"),
        ("mixture for a classifier", {**no_files, "dataset_mixture": {"datasets": [{"id": train}]}}, [], {},
         "dataset_mixture", "the classifier trains on one labelled dataset", "classify"),
        ("resume with another global batch", {**resume, "per_device_train_batch_size": 4}, [], {},
         "per_device_train_batch_size", "global batch of 4 rows, this run has 8"),
    ]


@pytest.mark.slow  # ~25 s (one real run to point at, then the cases): the full suite runs it, the quick layer not
def test_bad_inputs_stop_early_with_one_message_and_touch_nothing(tmp_path, tmp_path_factory, existing, tiny_model,
                                                                  padded_data):
    files = _files(tmp_path_factory, padded_data)
    good = {**BASE, **padded_data, "model_name_or_path": tiny_model, "output_dir": existing,
            "overwrite_output_dir": True}
    cases, expected = [], {}
    for name, changes, extra, env, field, words, *recipe in _cases(existing, tiny_model, padded_data, files):
        if changes is None:  # a case about the config file itself: only argv
            argv = extra
        else:
            # Through a YAML file, as users write them (a None is a YAML null: "unset" for an optional field).
            config = tmp_path / f"case{len(cases)}.yaml"
            config.write_text(yaml.safe_dump({**good, **changes}))
            argv = ["--config", str(config), *extra]
        cases.append({"name": name, "argv": argv, "env": env, "recipe": recipe[0] if recipe else "gpt2"})
        expected[name] = (field, words)
    assert len(cases) == 102  # README.md and docs/reliability.md give this number
    before = tree_hash(existing)
    cases_file, out_file = tmp_path / "cases.json", tmp_path / "results.json"
    cases_file.write_text(json.dumps(cases))
    run([sys.executable, os.path.join(SCRIPTS, "battery.py"), str(cases_file), str(out_file)], timeout=900)
    results = json.load(open(out_file))
    failures = []
    for name, (field, words) in expected.items():
        r = results[name]
        lines = [line for line in r["stderr"].splitlines() if line.startswith("config error:")]
        ok = (r["code"] == 2 and len(lines) == 1 and lines[0].startswith(f"config error: {field}:")
              and words in lines[0] and "Traceback" not in r["stderr"] and not r["weights_loaded"])
        if not ok:
            failures.append(f"{name}: exit {r['code']}, weights loaded: {r['weights_loaded']}, "
                            f"expected '{field}: ...{words}...', stderr: {r['stderr'][-600:]}")
    assert not failures, "\n\n".join(failures)
    assert tree_hash(existing) == before, "a case changed the existing run's files"


@pytest.mark.slow
def test_recipe_exit_code_and_message_from_a_shell(existing, tiny_model, padded_data):
    """The same path from a real command line: one line on stderr, exit 2 (the battery runs the recipe's cli)."""
    cfg = {**BASE, **padded_data, "model_name_or_path": tiny_model, "output_dir": existing,
           "resume_from_checkpoint": os.path.join(existing, "checkpoints", "step-1"), "seed": 8}
    proc = run([sys.executable, RECIPE, *args_from(cfg)], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("config error: seed: cannot resume from")
