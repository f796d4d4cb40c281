"""``toolkit chat DIR`` (toolkit.cli.chat): an export is found from a run folder, a full model and a LoRA adapter (onto
the base the run's config names, from any folder) answer through the chat template exactly as ``generate`` does, the
conversation carries over typed turns, piped lines are answered each on its own, a turn of several lines goes
between two lines of three double quotes, and a folder with no export is one line and exit 2."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, subprocess_env

from toolkit.cli import chat as talk
from toolkit.errors import ConfigError


def _export(tmp_path, tiny_model, chats) -> str:
    """A run folder whose final/ is the tiny model with the tests' chat template (what save_final writes)."""
    from transformers import AutoTokenizer

    final = tmp_path / "run" / "final"
    shutil.copytree(tiny_model, final)
    tok = AutoTokenizer.from_pretrained(final)
    tok.chat_template = open(chats["chat_template"]).read()
    tok.save_pretrained(final)
    return str(final.parent)


def _args(**kw) -> argparse.Namespace:
    return talk.parse([".", *[f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]])


def _greedy(model, tok, messages, n):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_a_run_folder_answers_greedily_through_its_template_and_keeps_the_conversation(tmp_path, tiny_model, chats):
    run = _export(tmp_path, tiny_model, chats)
    assert talk.export_folder(run) == talk.export_folder(run + "/final") == run + "/final"
    tok, model = talk.load(talk.export_folder(run))
    said = []
    lines = ["A list?\n", "A tuple?\n", "/reset\n", "Hi\n", "/quit\n", "x\n"]
    assert talk.converse(model, tok, lines, said.append, _args(max_new_tokens=4)) == 3
    first = [{"role": "user", "content": "A list?"}]
    second = first + [{"role": "assistant", "content": said[0]}, {"role": "user", "content": "A tuple?"}]
    assert said == [_greedy(model, tok, first, 4), _greedy(model, tok, second, 4),
                    _greedy(model, tok, [{"role": "user", "content": "Hi"}], 4)]
    said.clear()
    assert talk.converse(model, tok, ["Hi"], said.append, _args(max_new_tokens=4, system="Be brief.")) == 1
    assert said == [_greedy(model, tok, [{"role": "system", "content": "Be brief."}, first[0] | {"content": "Hi"}], 4)]
    args = _args(max_new_tokens=4)
    # the tiny model's 64 positions: a turn that leaves no room is refused in words and taken back
    said.clear()
    assert talk.converse(model, tok, ["word " * 70], said.append, args) == 0
    assert said == ["(the conversation fills the model's 64-token context: /reset to start again)"]


def test_an_adapter_export_loads_onto_the_base_its_run_names(tmp_path, tiny_model, chats):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.models.lora import save_adapter

    run = tmp_path / "lora-run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text(f"model_name_or_path: {tiny_model}\nuse_peft: true\n")
    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                                LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False,
                                                           task_type="CAUSAL_LM"))
    save_adapter(peft_model, peft_model.state_dict(), str(run / "final"))  # what a LoRA run's export writes
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = open(chats["chat_template"]).read()
    tok.save_pretrained(run / "final")
    _, model = talk.load(talk.export_folder(str(run)))
    assert type(model).__name__ == "PeftModelForCausalLM"
    ids = torch.tensor([[5, 6, 7, 8]])
    peft_model.eval()
    torch.testing.assert_close(model(ids).logits, peft_model(ids).logits, rtol=0, atol=0)


def test_piped_lines_are_answered_each_on_its_own_and_a_block_is_one_turn(tmp_path, tiny_model, chats):
    """Without ``conversation`` (piped lines, unless --conversation) each turn is a conversation of its own; the lines
    between two lines of three double quotes are one turn, joined by newlines (Alpaca's instruction, a blank line,
    its input, as the SFT recipe formats them), also left open at the end of the input; a typed conversation keeps
    a block like any turn."""
    tok, model = talk.load(talk.export_folder(_export(tmp_path, tiny_model, chats)))
    said = []
    lines = ["A list?\n", "A tuple?\n", '"""\n', "Name a type.\n", "\n", "  int or str\n", '"""\n', "/reset\n",
             '"""\n', "Open\n", "block"]
    assert talk.converse(model, tok, lines, said.append, _args(max_new_tokens=4), conversation=False) == 4
    alone = [[{"role": "user", "content": text}] for text in
             ("A list?", "A tuple?", "Name a type.\n\n  int or str", "Open\nblock")]
    assert said == [_greedy(model, tok, messages, 4) for messages in alone]
    said.clear()
    assert talk.converse(model, tok, lines[2:7] + ["A tuple?"], said.append, _args(max_new_tokens=4)) == 2
    both = alone[2] + [{"role": "assistant", "content": said[0]}, *alone[1]]
    assert said == [_greedy(model, tok, alone[2], 4), _greedy(model, tok, both, 4)]


@pytest.mark.slow  # a toolkit chat subprocess (its imports: about 6 s)
def test_a_lora_run_chats_from_any_folder_without_upstream_noise(tmp_path, tiny_model, chats, monkeypatch):
    """A LoRA run that trained in one folder on a base named by a relative path, chatted with from another folder
    (``toolkit chat`` as a user runs it, lines piped): the run recorded its base as an absolute path (config.yaml and
    the adapter's base_model_name_or_path), so the adapter loads onto it; each piped line is answered on its own,
    as the adapter on its base answers it; bitsandbytes' notice of a missing optional kernel package is not printed.
    Before: ~40 lines ending in "Repo id must be in the form ...", and the notice on every chat."""
    import json

    from peft import get_peft_model
    from transformers import AutoTokenizer

    from toolkit.config import config_from_dict, write_config
    from toolkit.models.loading import load_model
    from toolkit.models.lora import lora_config, save_adapter

    trained_in, elsewhere = tmp_path / "trained_in", tmp_path / "elsewhere"
    shutil.copytree(tiny_model, trained_in / "models" / "base")
    elsewhere.mkdir()
    monkeypatch.chdir(trained_in)
    cfg = config_from_dict({"model_name_or_path": "models/base", "use_peft": True, "lora_target_modules": "c_attn",
                            "train_file": chats["train_file"], "output_dir": "run"})
    write_config(cfg, "run/config.yaml")  # what the loop writes when the run starts
    config = lora_config(cfg.model, "CAUSAL_LM")
    config.init_lora_weights = False  # "trained": B is not zero
    torch.manual_seed(0)
    peft_model = get_peft_model(load_model(cfg.model), config).eval()
    save_adapter(peft_model, peft_model.state_dict(), "run/final")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = open(chats["chat_template"]).read()
    tok.save_pretrained("run/final")
    base = str(trained_in / "models" / "base")
    assert json.load(open("run/final/adapter_config.json"))["base_model_name_or_path"] == base
    questions = ["A list?", "A tuple?"]
    out = subprocess.run([sys.executable, "-m", "toolkit", "chat", str(trained_in / "run"), "--max-new-tokens", "4"],
                         cwd=elsewhere, env=subprocess_env(), input="".join(q + "\n" for q in questions),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    expected = [_greedy(peft_model, tok, [{"role": "user", "content": q}], 4) for q in questions]
    assert out.stdout.splitlines() == expected
    assert "gemm_4bit_forward" not in out.stderr and "kernels" not in out.stderr, out.stderr


def test_a_folder_without_an_export_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "toolkit", "chat", str(tmp_path)], cwd=ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"config error: dir: {tmp_path} holds no exported model "
                                               "(config.json) and no final/; give a run's output_dir or its final/ "
                                               "folder (a finished run's export)"]


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nowhere does not exist"):
        talk.export_folder(str(tmp_path / "nowhere"))
