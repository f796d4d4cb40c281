"""``toolkit chat DIR``: talk to a model a run exported, the quick look at what training did.

    toolkit chat outputs/sft-smollm2              # a run's folder: its final/ export
    toolkit chat outputs/sft-smollm2/final [--system TEXT] [--max-new-tokens 128] [--temperature 0.7]
    toolkit chat outputs/sft-smollm2 < questions.txt    # each line answered on its own
    toolkit chat outputs/sft-smollm2 --conversation < turns.txt    # the lines as one conversation

Each line typed is a user turn; the model answers through its chat template, greedily unless ``--temperature`` is
above 0, and the conversation goes on (``/reset`` starts a new one, ``/quit`` or end of input ends it). Lines read
from a pipe are answered each on its own, a new conversation for every line (a script's fixed list of questions),
unless ``--conversation`` makes them one conversation, as typed lines are. A turn of several lines (Alpaca's
instruction, a blank line, then its input, as the SFT recipe trained it) goes between two lines that hold only
``\"\"\"``, typed or piped. A model without a chat template (the causal-LM recipe's) continues each turn as plain text
instead, and says so once.

DIR is an export of ``save_final`` (``toolkit.checkpointing``): the full weights, or a LoRA adapter, which is loaded
onto its base model as the run loaded it (``toolkit.models.loading.adapter_base_arguments``: the run's ``config.yaml`` beside
``final/``, whose base is an absolute path for a local folder, or the adapter's recorded base).
"""

from __future__ import annotations

import argparse
import os
import sys

from toolkit import layout
from toolkit.errors import ConfigError

COMMANDS = {"/reset": "start a new conversation", "/quit": "end", '"""': "opens and closes a turn of several lines"}
BLOCK = '"""'  # a line holding only this opens, and the next one closes, a turn of several lines


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="toolkit chat", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("dir", help="a run's output_dir (its final/) or an export folder")
    p.add_argument("--system", default=None, help="a system message that starts every conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the longest answer, in tokens (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sampled")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (with --temperature)")
    p.add_argument("--conversation", action="store_true",
                   help="piped lines form one conversation, as typed ones do (default: each answered on its own)")
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

    from toolkit.models.loading import adapter_base_arguments, is_adapter_folder
    from toolkit.models.lora import load_exported

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
    from toolkit.models.generation import continuation

    return continuation(model, tokenizer, prompt_ids(tokenizer, messages), max_new_tokens, temperature)


def context_length(model) -> int | None:
    from toolkit.models.loading import max_positions

    return max_positions(model.config)


def turns(lines):
    """The user turns in ``lines``: each line stripped, or the lines between two ``BLOCK`` lines joined by newlines
    (an end of input closes an open block). A ``Reader`` is told whether a block is open (its prompt)."""
    block = None
    for line in lines:
        line = line.rstrip("\r\n")
        if line.strip() == BLOCK:
            if block is not None:
                yield "\n".join(block).strip()
            block = [] if block is None else None
        elif block is not None:
            block.append(line)
        else:
            yield line.strip()
        if isinstance(lines, Reader):
            lines.in_block = block is not None
    if block is not None:
        yield "\n".join(block).strip()


def converse(model, tokenizer, lines, write, args: argparse.Namespace, conversation: bool = True) -> int:
    """Answer each turn of ``lines`` (``turns``; ``write`` prints); returns the number of answers. ``conversation``:
    the turns are one conversation (``/reset`` starts another); otherwise each is answered on its own."""
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages, answered = list(start), 0
    for turn in turns(lines):
        if turn == "/quit":
            break
        if turn == "/reset" or not turn:
            messages = list(start) if turn else messages
            continue
        if not conversation:
            messages = list(start)
        messages.append({"role": "user", "content": turn})
        reply = answer(model, tokenizer, messages, args.max_new_tokens, args.temperature)
        if reply is None:  # not even one new token fits: say so rather than answer nothing
            messages.pop()
            where = "conversation fills" if conversation else "turn fills"
            write(f"(the {where} the model's {context_length(model)}-token context"
                  f"{': /reset to start again' if conversation else ''})")
            continue
        messages.append({"role": "assistant", "content": reply})
        write(reply)
        answered += 1
    return answered


class Reader:
    """The input's lines, typed (with a prompt: ``... `` inside an open block) or piped; ``turns`` tells it
    whether a block is open."""

    def __init__(self, interactive: bool):
        self.interactive, self.in_block = interactive, False

    def __iter__(self):
        while True:
            try:
                yield input("... " if self.in_block else "> ") if self.interactive else next(sys.stdin)
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
        print(f"{folder}: the tokenizer has no chat template; each turn is continued as plain text", flush=True)
    elif interactive:
        print(f"{folder}: type a message ({', '.join(f'{k} {v}' for k, v in COMMANDS.items())})", flush=True)
    converse(model, tokenizer, Reader(interactive), lambda text: print(text, flush=True), args,
             conversation=interactive or args.conversation)
    return 0
