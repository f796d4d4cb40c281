"""``toolkit chat DIR``: talk to a model a run exported, the quick look at what training did.

    toolkit chat outputs/sft-smollm2              # a run's folder: its final/ export
    toolkit chat outputs/sft-smollm2/final [--system TEXT] [--max-new-tokens 128] [--temperature 0.7]

Each line typed is a user turn; the model answers through its chat template, greedily unless ``--temperature`` is
above 0, and the conversation goes on (``/reset`` starts a new one, ``/quit`` or end of input ends it). A model
without a chat template (the causal-LM recipe's) continues each line as plain text instead, and says so once. Lines
read from a pipe are answered the same way, one a line, so a script can ask a fixed list of questions.

DIR is an export of ``save_final`` (``toolkit.checkpointing``): the full weights, or a LoRA adapter, which is loaded
onto its base model as the run loaded it (the run's ``config.yaml`` beside ``final/``: the base's path, dtype and
loading fields), or onto the adapter's recorded base when the run's config is not there.
"""

from __future__ import annotations

import argparse
import os
import sys

from toolkit import layout
from toolkit.errors import ConfigError

COMMANDS = {"/reset": "start a new conversation", "/quit": "end"}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="toolkit chat", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("dir", help="a run's output_dir (its final/) or an export folder")
    p.add_argument("--system", default=None, help="a system message that starts every conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the longest answer, in tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sampled")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (with --temperature)")
    return p.parse_args(argv)


def export_folder(path: str) -> str:
    """The export ``path`` names: itself, or the ``final/`` of a run folder. Refused with one line otherwise."""
    if layout.has_final_model(path):
        return layout.final_dir(path)
    if os.path.isfile(os.path.join(path, "config.json")) or os.path.isfile(os.path.join(path, "adapter_config.json")):
        return path
    why = "does not exist" if not os.path.exists(path) else "holds no exported model (config.json) and no final/"
    raise ConfigError("dir", f"{path} {why}; give a run's output_dir or its final/ folder (a finished run's export)")


def load(folder: str):
    """(tokenizer, model in eval mode) of an export."""
    from transformers import AutoTokenizer

    from toolkit.lora import load_exported
    from toolkit.model import adapter_base_arguments, is_adapter_folder

    model = load_exported(folder, adapter_base_arguments(folder) if is_adapter_folder(folder) else None)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer, model.eval()


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The ids the model continues: the chat through its template with the generation prompt (what the SFT recipe
    trained the answers after), or, with no template, the last line as plain text."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return tokenizer(messages[-1]["content"])["input_ids"]


def answer(model, tokenizer, messages: list[dict], max_new_tokens: int, temperature: float = 0.0) -> str | None:
    """The model's answer to the chat so far (greedy at temperature 0), without its end-of-turn token; None when the
    chat leaves no room in the model's context for a new token."""
    from toolkit.generation import continuation

    return continuation(model, tokenizer, prompt_ids(tokenizer, messages), max_new_tokens, temperature)


def context_length(model) -> int | None:
    from toolkit.model import max_positions

    return max_positions(model.config)


def converse(model, tokenizer, lines, write, args: argparse.Namespace) -> int:
    """Answer each line of ``lines`` in turn (``write`` prints); returns the number of answers."""
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages, answered = list(start), 0
    for line in lines:
        line = line.strip()
        if line == "/quit":
            break
        if line == "/reset" or not line:
            messages = list(start) if line else messages
            continue
        messages.append({"role": "user", "content": line})
        reply = answer(model, tokenizer, messages, args.max_new_tokens, args.temperature)
        if reply is None:  # not even one new token fits: say so rather than answer nothing
            messages.pop()
            write(f"(the conversation fills the model's {context_length(model)}-token context: /reset to start again)")
            continue
        messages.append({"role": "assistant", "content": reply})
        write(reply)
        answered += 1
    return answered


def _lines(interactive: bool):
    while True:
        try:
            yield input("> ") if interactive else next(sys.stdin)
        except (EOFError, StopIteration):
            return


def main(argv: list[str] | None = None) -> int:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    try:
        folder = export_folder(args.dir)
    except ConfigError as e:
        sys.stderr.write(f"config error: {e}\n")
        return 2
    import torch

    torch.manual_seed(args.seed)
    tokenizer, model = load(folder)
    interactive = sys.stdin.isatty()
    if not getattr(tokenizer, "chat_template", None):
        print(f"{folder}: the tokenizer has no chat template; each line is continued as plain text", flush=True)
    elif interactive:
        print(f"{folder}: type a message ({', '.join(f'{k} {v}' for k, v in COMMANDS.items())})", flush=True)
    converse(model, tokenizer, _lines(interactive), lambda text: print(text, flush=True), args)
    return 0
