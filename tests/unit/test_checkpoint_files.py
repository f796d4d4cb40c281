"""Checkpoint folders on disk: which ones count, which one is latest, which ones rotation deletes, what loads where.

On real folders under tmp_path (``rotate_checkpoints`` and ``toolkit.layout`` touch only the file system, so no
Accelerator is needed): only ``step-N`` folders are checkpoints, in numeric order; ``step-N.tmp`` (a save in progress)
and any other name are never listed nor deleted; rotation keeps the N newest but never a protected one (the
checkpoint this run resumed from); the ``latest`` pointer wins when it names a folder, else the newest checkpoint.
The final exports (``save_final``), in process: each kind loaded back on three model families against the trained
model's logits, the check of an export against its architecture, and a LoRA run's ``final/`` as the next run's
model (SFT -> DPO -> GRPO).
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import yaml

from toolkit import layout
from toolkit.checkpointing.checkpoint import rotate_checkpoints


def _make(out, steps=(), tmp=(), others=()) -> str:
    """``out/checkpoints`` with step-N folders (each holding a file, as save_state leaves), step-N.tmp folders and
    other folders; returns out as a str."""
    out = str(out)
    for step in steps:
        os.makedirs(layout.step_dir(out, step))
        open(os.path.join(layout.step_dir(out, step), "model.safetensors"), "w").close()
    for step in tmp:
        os.makedirs(layout.step_dir(out, step) + layout.TMP_SUFFIX)
    for name in others:
        os.makedirs(os.path.join(layout.checkpoints_dir(out), name))
    return out


def _steps(out) -> list[int]:
    return [step for step, _ in layout.list_checkpoints(out)]


def _entries(out) -> list[str]:
    return sorted(os.listdir(layout.checkpoints_dir(out)))


def _point(out, name: str) -> None:
    with open(os.path.join(layout.checkpoints_dir(out), layout.LATEST), "w") as f:
        f.write(name)


# ------------------------------------------------------------------------------------------------ listing
def test_list_is_numeric_and_ignores_tmp_and_other_names(tmp_path):
    out = _make(tmp_path, steps=[10, 2, 9], tmp=[11], others=["step-x", "Step-4", "step-7-old", "final"])
    open(os.path.join(layout.checkpoints_dir(out), "step-5"), "w").close()  # a file, not a folder
    _point(out, "step-9")
    # step-10 after step-9 (a lexicographic sort would put it first); paths are the ones step_dir names
    assert layout.list_checkpoints(out) == [(s, layout.step_dir(out, s)) for s in (2, 9, 10)]


def test_no_checkpoints_folder(tmp_path):
    assert layout.list_checkpoints(str(tmp_path)) == []
    assert layout.latest_checkpoint(str(tmp_path)) is None


# ----------------------------------------------------------------------------------------------- rotation
def test_rotation_keeps_the_newest(tmp_path):
    out = _make(tmp_path, steps=range(1, 6))
    rotate_checkpoints(out, 2, keep={layout.step_dir(out, 5), None})  # None: save_checkpoint's protect when not resumed
    assert _steps(out) == [4, 5]


def test_rotation_is_numeric(tmp_path):
    """A lexicographic order ("step-10" < "step-8") would delete the two newest."""
    out = _make(tmp_path, steps=[8, 9, 10, 11])
    rotate_checkpoints(out, 2, keep={layout.step_dir(out, 11)})
    assert _steps(out) == [10, 11]


def test_protected_checkpoint_survives_even_when_oldest(tmp_path, monkeypatch):
    out = _make(tmp_path / "out", steps=range(1, 6))
    monkeypatch.chdir(tmp_path)
    # The resumed-from folder as the user typed it (relative): rotation compares absolute paths.
    protect = os.path.join("out", layout.CHECKPOINTS, "step-1")
    rotate_checkpoints(out, 2, keep={layout.step_dir(out, 5), protect})
    assert _steps(out) == [1, 5]  # the limit is still met: the next oldest ones went instead
    assert os.path.isfile(os.path.join(layout.step_dir(out, 1), "model.safetensors"))


def test_protection_can_keep_more_than_the_limit(tmp_path):
    """With limit 1 and two protected folders, everything else goes and the two stay: as far down as it can."""
    out = _make(tmp_path, steps=range(1, 6))
    rotate_checkpoints(out, 1, keep={layout.step_dir(out, 5), layout.step_dir(out, 1)})
    assert _steps(out) == [1, 5]


@pytest.mark.parametrize("limit", [None, 0])
def test_no_limit_deletes_nothing(tmp_path, limit):
    out = _make(tmp_path, steps=range(1, 6))
    rotate_checkpoints(out, limit, keep=set())
    assert _steps(out) == [1, 2, 3, 4, 5]


def test_rotation_never_touches_tmp_or_other_folders(tmp_path):
    out = _make(tmp_path, steps=range(1, 5), tmp=[0, 5], others=["notes"])
    _point(out, "step-4")
    rotate_checkpoints(out, 1, keep={layout.step_dir(out, 4)})
    # step-0.tmp is "older" than every checkpoint and step-5.tmp is "newer": neither is counted nor deleted
    assert _entries(out) == ["latest", "notes", "step-0.tmp", "step-4", "step-5.tmp"]


# ------------------------------------------------------------------------------------------ latest, resume
def test_latest_pointer_wins_when_valid(tmp_path):
    out = _make(tmp_path, steps=[3, 5])
    _point(out, "step-3\n")  # a trailing newline (hand-edited file) is tolerated
    assert layout.latest_checkpoint(out) == layout.step_dir(out, 3)


def test_latest_falls_back_without_pointer(tmp_path):
    out = _make(tmp_path, steps=[9, 10], tmp=[11])
    assert layout.latest_checkpoint(out) == layout.step_dir(out, 10)  # numeric, and never the .tmp one


def test_latest_falls_back_when_pointer_names_a_deleted_folder(tmp_path):
    out = _make(tmp_path, steps=[2, 4], tmp=[6])
    _point(out, "step-7")
    assert layout.latest_checkpoint(out) == layout.step_dir(out, 4)


def test_latest_is_none_with_only_a_save_in_progress(tmp_path):
    out = _make(tmp_path, tmp=[1])
    assert layout.latest_checkpoint(out) is None


@pytest.mark.parametrize("pointer", ["", "..", "step-2.tmp", "other"])
def test_a_pointer_that_names_no_complete_checkpoint_falls_back(tmp_path, pointer):
    """An empty pointer once returned the checkpoints folder itself; '..' a folder outside it; a '.tmp' name an
    unfinished save. Only a complete step-N counts."""
    out = _make(tmp_path, steps=[1, 2])
    os.makedirs(os.path.join(layout.checkpoints_dir(out), "step-2.tmp"), exist_ok=True)
    os.makedirs(os.path.join(layout.checkpoints_dir(out), "other"), exist_ok=True)
    _point(out, pointer)
    assert layout.latest_checkpoint(out) == layout.step_dir(out, 2)


def test_resolve_resume(tmp_path):
    out = _make(tmp_path, steps=[1, 3])
    assert layout.resolve_resume(out, None) is None
    assert layout.resolve_resume(out, "") is None
    assert layout.resolve_resume(out, "latest") == layout.step_dir(out, 3)
    _point(out, "step-1")
    assert layout.resolve_resume(out, "latest") == layout.step_dir(out, 1)
    elsewhere = str(tmp_path / "some" / "folder")
    assert layout.resolve_resume(out, elsewhere) == elsewhere  # a folder is taken as given (config checks it exists)
    assert layout.resolve_resume(str(tmp_path / "empty"), "latest") is None


def test_move_run_aside_keeps_everything_and_only_run_files(tmp_path):
    out = _make(tmp_path, steps=[1, 2])
    _point(out, "step-2")
    for name in (layout.METRICS, layout.CONFIG):
        with open(os.path.join(out, name), "w") as f:
            f.write(name)
    with open(os.path.join(out, "notes.txt"), "w") as f:  # not a run file: stays where the user put it
        f.write("mine")
    aside = layout.move_run_aside(out)
    assert os.path.basename(aside).startswith(layout.REPLACED_PREFIX)
    assert sorted(os.listdir(out)) == sorted(["notes.txt", os.path.basename(aside)])
    assert open(os.path.join(aside, layout.METRICS)).read() == layout.METRICS
    assert layout.latest_checkpoint(aside) == layout.step_dir(aside, 2)
    assert layout.move_run_aside(out) is None  # nothing left to move
    # a second replaced run in the same second gets its own folder
    with open(os.path.join(out, layout.METRICS), "w") as f:
        f.write("again")
    assert layout.move_run_aside(out) != aside


def test_remove_stale_temporaries_only_touches_tmp(tmp_path):
    out = _make(tmp_path, steps=[1], tmp=[2])
    os.makedirs(os.path.join(out, layout.FINAL + layout.TMP_SUFFIX))
    with open(os.path.join(layout.checkpoints_dir(out), layout.LATEST + layout.TMP_SUFFIX), "w") as f:
        f.write("step-2")
    removed = layout.remove_stale_temporaries(out)
    assert len(removed) == 3
    assert sorted(os.listdir(layout.checkpoints_dir(out))) == ["step-1"]
    assert not os.path.exists(os.path.join(out, layout.FINAL + layout.TMP_SUFFIX))


# ------------------------------------------------------------------------------------------ converted copies
def test_a_converted_copy_is_no_checkpoint_and_goes_with_its_original(tmp_path):
    """``step-N.universal`` (a ZeRO checkpoint converted for another world size) is never listed nor pointed at; when
    rotation deletes step-N it deletes the copy too, and never another step's (step-10 is not step-1's copy)."""
    out = _make(tmp_path, steps=[1, 2, 10], others=["step-1.universal", "step-10.universal", "step-1.universal.tmp"])
    assert layout.converted_dir(layout.step_dir(out, 1) + "/", "universal") == layout.step_dir(out, 1) + ".universal"
    assert layout.converted_copies(layout.step_dir(out, 1)) == [layout.step_dir(out, 1) + ".universal"]
    assert _steps(out) == [1, 2, 10]
    _point(out, "step-1.universal")
    assert layout.latest_checkpoint(out) == layout.step_dir(out, 10)
    rotate_checkpoints(out, 2, keep={layout.step_dir(out, 10)})
    assert _entries(out) == ["latest", "step-1.universal.tmp", "step-10", "step-10.universal", "step-2"]


# ------------------------------------------------------------------------------------------ what loads where
@pytest.mark.parametrize("wrote, world, strategy, ranks, plan", [
    ("ddp", 2, "single", 1, None),  # plain files load anywhere
    ("single", 1, "ddp", 4, None),
    ("fsdp2", 2, "fsdp2", 1, None),  # DCP reshards
    ("fsdp2", 1, "fsdp2", 2, None),
    ("fsdp2", 2, "single", 1, "plain"),  # DCP read without a process group
    ("fsdp2", 1, "ddp", 2, "plain"),
    ("deepspeed-zero3", 2, "deepspeed-zero3", 2, None),
    ("deepspeed-zero3", 2, "deepspeed-zero3", 1, "universal"),
    ("deepspeed-zero2", 1, "deepspeed-zero2", 4, "universal"),
    ("fsdp1", 2, "fsdp1", 2, None),
])
def test_load_plan_loads_or_converts(wrote, world, strategy, ranks, plan):
    from toolkit.checkpointing.resume import load_plan

    assert load_plan("ck", {"strategy": wrote, "loop": {"world_size": world}}, strategy, ranks) == plan


@pytest.mark.parametrize("wrote, world, strategy, ranks, command", [
    ("fsdp1", 2, "fsdp1", 1, "--config_file accelerate_configs/fsdp1.yaml --num_processes 2 "),
    ("deepspeed-zero3", 2, "single", 1, "--config_file accelerate_configs/zero3.yaml <recipe>"),
    ("deepspeed-zero3", 2, "deepspeed-zero2", 2, "--config_file accelerate_configs/zero3.yaml <recipe>"),
    ("ddp", 2, "deepspeed-zero3", 2, "--config_file accelerate_configs/ddp.yaml <recipe>"),
])
def test_load_plan_refuses_what_no_conversion_loads(wrote, world, strategy, ranks, command):
    from toolkit.checkpointing.resume import load_plan
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_plan("ck", {"strategy": wrote, "loop": {"world_size": world}}, strategy, ranks)
    assert e.value.field_name == "resume_from_checkpoint"
    assert f"written by {world} rank(s) under {wrote}" in str(e.value) and command in str(e.value)


# ------------------------------------------------------------------------------ re-saved checkpoints (issue 25)
class _MainProcess:
    """The part of an Accelerator that ``convert`` and ``save_checkpoint`` use, for one process."""

    is_main_process = True
    parallelism_config = None

    def __init__(self, payload=""):
        self.payload = payload

    def wait_for_everyone(self):
        pass

    def save_state(self, folder):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "model.safetensors"), "w") as f:
            f.write(self.payload)


def _read(folder, name="model.safetensors"):
    with open(os.path.join(folder, name)) as f:
        return f.read()


def test_a_converted_copy_of_a_re_saved_checkpoint_is_redone(tmp_path, monkeypatch):
    """A rolled-back run saves step 1 again: the ``step-1.plain`` converted from the first step-1 must not be loaded
    (it is the old trajectory). Before the fix the copy was reused because its folder existed."""
    from toolkit.checkpointing import convert
    from toolkit.checkpointing.checkpoint import save_checkpoint

    calls = []

    def fake(checkpoint, tmp, model):
        calls.append(checkpoint)
        with open(os.path.join(tmp, "model.safetensors"), "w") as f:
            f.write("converted " + _read(checkpoint))

    monkeypatch.setitem(convert._CONVERTERS, "plain", fake)
    out = str(tmp_path)
    first = save_checkpoint(_MainProcess("first"), out, 1, None, record={"loop": {"step": 1}})
    target = convert.convert(_MainProcess(), first, "plain", model=None, log=lambda *_: None)
    assert _read(target) == "converted first"
    convert.convert(_MainProcess(), first, "plain", model=None, log=lambda *_: None)
    assert len(calls) == 1  # the same step-1: reused
    # a copy left beside a re-saved step-1 (save_checkpoint deletes it; a copy made by a killed run may survive)
    stale = str(tmp_path / "kept")
    os.rename(target, stale)
    save_checkpoint(_MainProcess("second"), out, 1, None, record={"loop": {"step": 1, "again": True}})
    assert not os.path.exists(target)  # the replaced step's copies went with it
    os.rename(stale, target)
    assert not convert.is_current(target, layout.fingerprint(first))
    convert.convert(_MainProcess(), first, "plain", model=None, log=lambda *_: None)
    assert len(calls) == 2 and _read(target) == "converted second"
    assert not os.path.exists(target + layout.OLD_SUFFIX)


def test_replacing_a_checkpoint_never_leaves_neither(tmp_path):
    """The re-save of step-N renames the old one aside (``step-N.old.tmp``) before the new one goes in; a run killed
    between the two renames gets the old one back from ``remove_stale_temporaries``, never nothing."""
    out = _make(tmp_path, steps=[1])
    new = layout.step_dir(out, 1) + layout.TMP_SUFFIX
    os.makedirs(new)
    open(os.path.join(new, "model.safetensors"), "w").close()
    layout.replace_dir(new, layout.step_dir(out, 1))
    assert _entries(out) == ["step-1"]
    # killed after the first rename: only step-1.old.tmp and the new step-1.tmp
    os.rename(layout.step_dir(out, 1), layout.step_dir(out, 1) + layout.OLD_SUFFIX)
    os.makedirs(new)
    layout.remove_stale_temporaries(out)
    assert _entries(out) == ["step-1"] and os.listdir(layout.step_dir(out, 1)) == ["model.safetensors"]


def test_a_re_export_replaces_final_without_a_moment_of_neither(tmp_path):
    """``final/`` is replaced the way a checkpoint is (``layout.replace_dir``); a re-export killed between its renames
    leaves ``final.old.tmp``, which the next run deletes (it exports again) like ``final.tmp``."""
    out = str(tmp_path / "out")
    final = layout.final_dir(out)
    for content in ("old", "new"):
        tmp = final + layout.TMP_SUFFIX
        os.makedirs(tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(content)
        layout.replace_dir(tmp, final)
    assert sorted(os.listdir(out)) == ["final"] and open(os.path.join(final, "config.json")).read() == "new"
    os.rename(final, final + layout.OLD_SUFFIX)  # killed after the first rename
    assert layout.remove_stale_temporaries(out) == [final + layout.OLD_SUFFIX]
    assert os.listdir(out) == []


# ------------------------------------------------------------------------- the final exports, loaded back (issue 46)
@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, bpe_2048) -> str:
    """A 2-layer, 32-wide Qwen2 (biased q/k/v projections) whose head is tied to its embedding, as Qwen2.5-0.5B's is."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = bpe_2048
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("models") / "tiny-qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def families(tiny_model, tiny_llama, tiny_qwen2) -> dict:
    return {"gpt2": tiny_model, "llama": tiny_llama, "qwen2": tiny_qwen2}


def _save_final(model, tokenizer, path: str, merge_lora: bool) -> None:
    """``save_final`` as a one-process run calls it, on a fresh Accelerator (accelerate's process-wide state reset
    before and after, as ``helpers.train_in_process`` does)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from toolkit.checkpointing.checkpoint import save_final

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        save_final(Accelerator(cpu=True), model, tokenizer, path, merge_lora=merge_lora)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _logits(model):
    import torch

    ids = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


EXPORTS = {"full": {}, "lora": {"use_peft": True}, "qlora": {"use_peft": True, "load_in_4bit": True}}


@pytest.mark.parametrize("kind", EXPORTS)
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_every_export_loads_back_as_the_trained_model(families, tmp_path, family, kind):
    """Each kind of final export (full weights; a LoRA adapter and its merge; on a 4-bit base, QLoRA's adapter and its
    merge) of each family (GPT-2: Conv1D layers, tied head; Llama: untied; Qwen2: biased projections, tied head),
    written by ``save_final`` from a model whose every trainable tensor moved (a stand-in for training), loads back
    with ``from_pretrained`` / ``load_exported`` and gives the trained model's logits: exactly for the full weights
    and an adapter on its own base, up to float rounding for a merge. Before the fix, QLoRA's merged GPT-2 held
    transformers' dequantized nn.Linear layout: its non-square weights failed to load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.config import ModelArguments
    from toolkit.models.loading import load_model
    from toolkit.models.lora import apply_lora, load_exported

    if kind == "qlora":
        pytest.importorskip("bitsandbytes")
    args = ModelArguments(model_name_or_path=families[family], lora_r=4, lora_alpha=8, lora_dropout=0.0,
                          lora_target_modules=["all-linear"], **EXPORTS[kind])
    model = load_model(args)
    if args.use_peft:
        model = apply_lora(model, args, "CAUSAL_LM", log=lambda *_: None)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # "trained": every trainable tensor moved (LoRA's B starts at zero)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    trained = _logits(model)
    final = str(tmp_path / "final")
    _save_final(model, AutoTokenizer.from_pretrained(args.model_name_or_path), final, merge_lora=args.use_peft)
    exported = load_exported(final, args)
    assert type(exported).__name__ == ("PeftModelForCausalLM" if args.use_peft else model.__class__.__name__)
    assert torch.equal(_logits(exported), trained), family
    if args.use_peft:
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(final, "merged"))
        # the adapter folder named as the next run's model: its base (as its run's config.yaml says: 4 bits, then
        # dequantized) with the adapter merged in, a plain model of the architecture
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(args)))  # as the loop writes it
        as_model = load_model(ModelArguments(model_name_or_path=final))
        for name, loaded in (("merged export", merged), ("adapter folder as a model", as_model)):
            assert type(loaded) is type(model.get_base_model()) and loaded.dtype == torch.float32, name
            diff = float((_logits(loaded) - trained).abs().max())
            print(f"{family} {kind}: {name}'s logits max|d| from the trained model {diff:.1e}")
            assert diff <= (1e-4 if args.load_in_4bit else 1e-5), (family, kind, name, diff)


def test_an_export_that_does_not_fit_its_architecture_is_refused(tiny_model, tmp_path):
    """``check_export``: a tensor transposed (what QLoRA's merged GPT-2 wrote), one missing, one unexpected: each
    named, from the files' headers against the architecture on the meta device. The tied head written once (as
    save_pretrained writes it) or twice passes. An adapter whose tensors do not fit its adapter_config.json on its
    base's architecture is named too."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from toolkit.checkpointing.checkpoint import check_export

    folder = str(tmp_path / "export")
    shutil.copytree(tiny_model, folder)
    check_export(folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
    cases = {"wrong shape: transformer.h.0.mlp.c_fc.weight [128, 32] (the architecture's [32, 128])":
             {**weights, "transformer.h.0.mlp.c_fc.weight": weights["transformer.h.0.mlp.c_fc.weight"].t()},
             "missing: transformer.h.1.ln_2.bias":
             {k: v for k, v in weights.items() if k != "transformer.h.1.ln_2.bias"},
             "unexpected: transformer.h.2.ln_2.bias": {**weights, "transformer.h.2.ln_2.bias": torch.zeros(32)}}
    for words, tensors in cases.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
        with pytest.raises(RuntimeError, match=f"^the export in {folder} does not fit .*: {re.escape(words)}$"):
            check_export(folder)
    save_file({**weights, "lm_head.weight": weights["transformer.wte.weight"].clone()},
              os.path.join(folder, "model.safetensors"))
    check_export(folder)
    # an adapter against its base's architecture wrapped by its adapter_config.json: r 4 written, r 8 said
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.models.lora import save_adapter

    adapter = str(tmp_path / "adapter")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                                LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    save_adapter(peft_model, peft_model.state_dict(), adapter)
    check_export(adapter)
    config = json.load(open(os.path.join(adapter, "adapter_config.json")))
    json.dump({**config, "r": 8}, open(os.path.join(adapter, "adapter_config.json"), "w"))
    with pytest.raises(RuntimeError, match=re.escape("wrong shape: base_model.model.transformer.h.0.attn.c_attn.lora_A."
                                                     "weight [4, 32] (the architecture's [8, 32])")):
        check_export(adapter)


class _Final:
    """The model a run ends with (its ``on_end`` callback), for its logits."""

    def on_end(self, accelerator, model, summary):
        self.model = accelerator.unwrap_model(model)


@pytest.mark.slow  # three runs in process (~8 CPU s): the full suite runs it, the quick layer not
def test_lora_runs_chain_sft_dpo_grpo_each_on_the_last_ones_final(gpt2_256, chats, pairs, tmp_path, monkeypatch):
    """``toolkit train grpo --model <a LoRA run>/final`` died in the ranks ("no file named model.safetensors"). A
    LoRA run's final/ named as a model loads as its base with the adapter merged in: the model that run trained.
    Chained in process, one step each: chat SFT (LoRA) -> DPO on its final/ (a new adapter: its reference, the base
    with that adapter disabled, is the SFT model, so the first loss is log 2) -> GRPO on DPO's final/ (a new adapter,
    merge_lora). GRPO's adapter records DPO's final/ as its base, which records SFT's: loaded back link by link
    (``toolkit chat``'s way) it gives the GRPO-trained model's logits, and so does its final/merged/."""
    import math
    import sys

    import torch
    from helpers import ROOT, train_in_process
    from transformers import AutoModelForCausalLM

    from toolkit.models.loading import adapter_base_arguments
    from toolkit.models.lora import load_exported
    from toolkit.reporting.metrics import read_metrics
    from toolkit.tasks.dpo import DPO
    from toolkit.tasks.grpo.task import GRPO
    from toolkit.tasks.sft import ChatSFT

    common = {"use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_modules": "c_attn",
              "max_steps": 1, "logging_steps": 1, "report_to": "none", "plot": False, "learning_rate": 0.05,
              "validation_split_percentage": 0, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}
    sft, dpo, grpo = (str(tmp_path / name) for name in ("sft", "dpo", "grpo"))
    train_in_process({**common, **chats, "validation_file": None, "model_name_or_path": gpt2_256,
                      "output_dir": sft}, task=ChatSFT())
    train_in_process({**common, **pairs, "validation_file": None, "model_name_or_path": os.path.join(sft, "final"),
                      "block_size": 256, "output_dir": dpo}, task=DPO())
    assert abs(read_metrics(dpo)[0]["loss"] - math.log(2)) < 1e-6
    final = _Final()
    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "tests", "scripts"), *sys.path])  # grpo_rewards
    grpo_common = {k: v for k, v in common.items() if k != "validation_split_percentage"}  # GRPO holds out nothing
    train_in_process({**grpo_common, "model_name_or_path": os.path.join(dpo, "final"), "dataset_name": "arithmetic",
                      "num_generations": 2, "max_completion_length": 4, "merge_lora": True,
                      "reward_funcs": ["grpo_rewards:characters"], "output_dir": grpo}, task=GRPO(), callbacks=[final])
    assert all(p.abs().max() > 0 for n, p in final.model.named_parameters() if "lora_B" in n)  # it trained
    folder = os.path.join(grpo, "final")
    assert adapter_base_arguments(folder).model_name_or_path == os.path.join(dpo, "final")
    assert adapter_base_arguments(os.path.join(dpo, "final")).model_name_or_path == os.path.join(sft, "final")
    trained = _logits(final.model)
    assert torch.equal(_logits(load_exported(folder, adapter_base_arguments(folder))), trained)
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "merged"))
    assert float((_logits(merged) - trained).abs().max()) <= 1e-5


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_classifier_adapter_loads_alone_with_peft_auto_class(families, tmp_path, family):
    """A classifier's LoRA export (its head of 6 labels new, trained whole: peft's modules_to_save) loads in one call,
    ``AutoPeftModelForSequenceClassification.from_pretrained(final)``, with the trained logits, exactly. peft loads
    the base adapter_config.json names with that base's own config: 2 labels, and the trained head did not fit (a
    size mismatch; the capability matrix's classifier LoRA cells). final/base/ is the base as the classifier it
    trained, its weight files hard links of the base's."""
    import peft
    import torch
    from transformers import AutoTokenizer

    from toolkit.config import ModelArguments
    from toolkit.models.loading import load_config, load_model
    from toolkit.models.lora import apply_lora

    args = ModelArguments(model_name_or_path=families[family], use_peft=True, lora_r=4, lora_alpha=8,
                          lora_dropout=0.0, lora_target_modules=["all-linear"])
    config = load_config(args)
    config.num_labels, config.id2label = 6, {i: f"class {i}" for i in range(6)}
    config.label2id = {v: k for k, v in config.id2label.items()}
    config.pad_token_id = config.eos_token_id
    model = apply_lora(load_model(args, config=config, auto_class="AutoModelForSequenceClassification"), args,
                       "SEQ_CLS", log=lambda *_: None)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # "trained": every trainable tensor moved (LoRA's B starts at zero), the head included
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    trained = _logits(model)
    final = str(tmp_path / "final")
    _save_final(model, AutoTokenizer.from_pretrained(args.model_name_or_path), final, merge_lora=False)
    loaded = peft.AutoPeftModelForSequenceClassification.from_pretrained(final)
    assert loaded.config.num_labels == 6 and loaded.config.id2label[5] == "class 5"
    assert torch.equal(_logits(loaded), trained), family
    base_weights = [f for f in os.listdir(families[family]) if f.endswith(".safetensors")]
    assert all(os.path.samefile(os.path.join(final, "base", f), os.path.join(families[family], f))
               for f in base_weights)  # hard links: no second copy of the base
