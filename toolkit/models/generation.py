"""Generation for a look at what a model says: the prompt of a tokenized chat and a model's greedy answer to it (the
SFT recipe prints one before and one after fine-tuning)."""

from __future__ import annotations

import torch

from toolkit.loss import IGNORE_INDEX
from toolkit.models.loading import load_model, max_positions, plain_loading
from toolkit.models.lora import load_exported


def first_prompt(dataset) -> list[int]:
    """The prompt tokens of a tokenized dataset's first chat: everything before its first assistant token."""
    row = dataset.head(1)[0] if hasattr(dataset, "head") else dataset[0]  # a stream (toolkit.data.stream): its first row
    first = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
    return row["input_ids"][:first]


def show_answer(accelerator, cfg, tokenizer, prompt_ids: list[int], folder: str | None, when: str,
                max_new_tokens: int = 48) -> str | None:
    """On the main process: load the model (the configured pretrained one, or the export in ``folder``) as a plain
    single-process model and print its greedy answer to ``prompt_ids``. Other ranks return None at once."""
    if not accelerator.is_main_process:
        return None
    with plain_loading(accelerator):
        model = load_exported(folder, cfg.model) if folder else load_model(cfg.model)
    model.eval()
    answer = continuation(model, tokenizer, prompt_ids, max_new_tokens)
    if answer is None:
        return None
    print(f"--- {when}: {tokenizer.decode(prompt_ids, skip_special_tokens=True).strip()[-200:]!r}\n{answer}",
          flush=True)
    return answer


def continuation(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0) -> str | None:
    """The text ``model`` writes after ``prompt_ids`` (greedy at temperature 0, else sampled), special tokens left
    out; at most ``max_new_tokens``, fewer where the model's context ends first, None where it leaves no room."""
    positions = max_positions(model.config)  # a small model's context may end before max_new_tokens
    if positions is not None:
        max_new_tokens = min(max_new_tokens, positions - len(prompt_ids))
    if max_new_tokens <= 0:
        return None
    ids = torch.tensor([prompt_ids])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             pad_token_id=pad, **sampling)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
