"""Sampling that is part of the sample order: each completion drawn with its own ``torch.Generator``, seeded from
(seed, step, prompt index, generation index), through ``model.generate``.

Why per row: a batch drawn from one generator gives row j the numbers left after rows 0..j-1, so the same completion
would change with the micro-batch size, the world size or the rank it lands on. Here ``model.generate`` runs greedy
(``do_sample=False``) behind ``RowSampler``, a logits processor that turns each row's scores into its sampling
distribution (transformers' own temperature, top-k and top-p warpers, row by row), draws that row's token with that
row's generator, and leaves it the only token greedy can pick. A row's draws then depend only on its seed and its own
logits (which a batch does not change beyond float rounding), whatever else is in the batch. Under ZeRO-3 and FSDP2
``synced_gpus`` keeps every rank's forward passes in step until all of them are done.

Nothing of the model's own ``generation_config`` shapes the draws but its EOS ids (TRL's: every one of them ends a
completion, ``eos_ids``): ``generate`` fills every field a passed config leaves unset from the model's, and
``suppress_tokens``, ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ``bad_words_ids`` ... are
logits processors that run before ``RowSampler``. The loss scores the model's logits over the temperature alone
(``toolkit.tasks.grpo.loss.completion_logps``), so such a processor would draw completions from another distribution than
the one the loss takes them from (off-policy, silently). ``sample`` hides the model's config while it generates.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch


def row_seed(seed: int, step: int, index: int, generation: int) -> int:
    """A 63-bit seed from (seed, step, prompt index, generation index): sha256, so that nearby tuples give unrelated
    streams."""
    digest = hashlib.sha256(f"{seed}/{step}/{index}/{generation}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class RowSampler:
    """A ``LogitsProcessor``: each row's next token drawn from its warped distribution with its own generator; the
    returned scores are 0 at that token and -inf elsewhere (greedy takes it)."""

    def __init__(self, seeds: list[int], temperature: float, top_k: int, top_p: float):
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, float("-inf"))
        for row, generator in enumerate(self.generators):
            row_ids, row_scores = input_ids[row:row + 1], scores[row:row + 1].float()
            for warp in self.warpers:  # one row at a time: nothing of another row can touch it
                row_scores = warp(row_ids, row_scores)
            probs = torch.softmax(row_scores, dim=-1).cpu()
            token = torch.multinomial(probs[0], 1, generator=generator)
            out[row, token.to(scores.device)] = 0.0
        return out


def eos_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion, TRL 1.16's (``GRPOTrainer.__init__``): the tokenizer's EOS, then each EOS id
    of the model's ``generation_config`` (a chat model's end of turn, e.g. ``<|im_end|>`` beside a tokenizer's
    ``<|endoftext|>``)."""
    declared = getattr(_generating_model(model).generation_config, "eos_token_id", None)
    declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    if tokenizer.eos_token_id is None or tokenizer.eos_token_id in declared:
        return declared
    return [tokenizer.eos_token_id, *declared]


def _generating_model(model):
    """The transformers model whose ``generate`` (and so whose ``generation_config``) runs: under a peft wrapper, its
    base model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def _without_generation_config(model):
    """The model's ``generation_config`` replaced by transformers' defaults while it generates (module docstring)."""
    from transformers import GenerationConfig

    inner = _generating_model(model)
    saved = inner.generation_config
    inner.generation_config = GenerationConfig()
    try:
        yield
    finally:
        inner.generation_config = saved


@torch.no_grad()
def sample(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seeds: list[int], *, max_new_tokens: int,
           temperature: float, top_k: int, top_p: float, pad_token_id: int, eos_token_id: int | list[int],
           synced_gpus: bool = False) -> torch.Tensor:
    """The completions (right of the left-padded prompts) of ``model.generate`` with ``RowSampler``: at most
    ``max_new_tokens`` each, a row stopped at any of ``eos_token_id`` and padded with ``pad_token_id`` after it.
    Nothing else of the model's ``generation_config`` applies (module docstring)."""
    from transformers import GenerationConfig, LogitsProcessorList

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                              eos_token_id=eos_token_id, num_beams=1, use_cache=True)
    # eagerly, under torch_compile too: decoding's shapes (a KV cache one token longer at each step, one-token
    # inputs, no grad) would each compile a graph of the compiled blocks, up to dynamo's recompile limit; the
    # compiled graphs are the training forward and backward's
    with _without_generation_config(model), torch.compiler.set_stance("force_eager"):
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config,
                             logits_processor=LogitsProcessorList([RowSampler(seeds, temperature, top_k, top_p)]),
                             synced_gpus=synced_gpus)
    return out[:, prompt_ids.shape[1]:]


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of each completion's tokens up to and with its first EOS, any of ``eos_token_id``; whether it has none:
    truncated), TRL's."""
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    is_eos = torch.isin(completion_ids, torch.tensor(ids, dtype=completion_ids.dtype, device=completion_ids.device))
    width = completion_ids.shape[1]
    first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), torch.full_like(is_eos[:, 0], width,
                                                                                        dtype=torch.long))
    positions = torch.arange(width, device=completion_ids.device).expand_as(completion_ids)
    return (positions <= first.unsqueeze(1)).long(), ~is_eos.any(dim=1)
