"""Causal language modelling: the task the ``lm`` recipe (``recipes/gpt2.py``) trains."""

from __future__ import annotations

import math

import torch

from toolkit.data import loading as data
from toolkit.data.mixture import load_task_splits
from toolkit.data.packing import ROW_LENGTHS
from toolkit.loss import count_targets, row_logit_sums, token_losses
from toolkit.tasks.base import Task, check_stream_packing, model_inputs, stream_limit


class CausalLM(Task):
    """Next-token prediction on plain text, packed into ``block_size`` rows or one document per row."""

    name = "causal-lm"
    auto_class = "AutoModelForCausalLM"
    peft_task_type = "CAUSAL_LM"
    best_metric = ("perplexity", min)  # the eval metric whose best value the summary reports, and which is best
    row_unit = "sequences"  # a packed row or one document (chat SFT: one chat, or whole chats packed)
    loss_unit = "nats/token"  # cross-entropy averaged over the next-token targets
    stream_refusal = None
    stream_schema = "text"  # the formats a stream's columns must fit (toolkit.data.formats; build.check_stream_head)

    def check(self, cfg) -> None:
        if cfg.data.packing is None:  # unset: this task's default (chat SFT and classification: false)
            cfg.data.packing = True
        if cfg.data.streaming:  # toolkit.data.stream: a stream packs whole documents, per micro-batch
            check_stream_packing(cfg.data)
        if cfg.data.packing and cfg.data.packing_strategy is None:
            cfg.data.packing_strategy = "wrapped"  # run_clm's concatenate-and-cut, the figures in the docs

    def stream_rows(self, tokenizer, args, block_size: int, fmt: str | None = None):
        column, eos = data.text_column(args), tokenizer.eos_token_id
        encode_texts, _ = data.token_encoder(tokenizer)

        def keep(row) -> bool | None:
            # null, empty or not text: dropped and counted (None), as the map-style path does (data.drop_null_texts)
            return True if data.has_text(row.get(column)) else None

        limit = stream_limit(args, block_size)
        keep.drops = f"rows with no text (null, empty or not a string) in column {column!r}"  # the log's count

        def encode(rows):
            ids = encode_texts([r[column] for r in rows])
            return [{"input_ids": (x + [eos] if eos is not None else x)[:limit]} for x in ids]

        return keep, encode

    def load_raw(self, args):
        raw, mixture = load_task_splits(args, "text", {data.PYDOC: data.pydoc_dataset})
        # as a stream drops them; the counts in summary.json (dropped_rows)
        raw = data.drop_null_texts(raw, data.text_column(args), self.log, self.data_record)
        if mixture is not None:
            self.data_record["dataset_mixture"] = mixture
        return raw

    def tokenize(self, raw, tokenizer, args, block_size: int):
        return data.tokenize_and_group(raw, tokenizer, args, block_size)

    def collator(self, tokenizer):
        return data.CausalLMCollator(tokenizer.pad_token_id)

    def count_targets(self, batch: dict) -> torch.Tensor:
        return count_targets(batch["labels"])

    def forward_rows(self, model, batch: dict, chunked: bool = False,
                     mean_logits: bool = False) -> tuple[torch.Tensor, ...]:
        """(row loss sums, row target counts), and with ``mean_logits`` each row's ``loss.row_logit_sums``: from the
        logits, or from the model's chunked loss (``chunked``). ``use_cache=False``: a training forward has no use for
        the key/value cache transformers would otherwise build (Trainer turns it off too); the config, and so
        generation after export, keeps its own setting."""
        rows = batch.get(ROW_LENGTHS)  # a flattened packed micro-batch: the loss per packed row (collate_packed)
        if chunked:
            inputs = {k: v for k, v in model_inputs(batch).items() if k != "use_cache"}  # the chunked forward's own
            extra = {"mean_logits": True} if mean_logits else {}
            if rows is not None:
                extra["row_lengths"] = rows
            out = model(**inputs, labels=batch["labels"], **extra)
            return tuple(out[k] for k in ("row_loss", "row_targets", "row_logit_sum")[:3 if mean_logits else 2])
        logits = model(**model_inputs(batch)).logits
        losses = token_losses(logits, batch["labels"], rows)
        return (*losses, row_logit_sums(logits, batch["labels"])) if mean_logits else losses

    def row_losses(self, model, batch: dict, chunked: bool = False) -> torch.Tensor:
        """Per-row summed token cross-entropy (``forward_rows``)."""
        return self.forward_rows(model, batch, chunked)[0]

    def eval_rows(self, model, batch: dict, chunked: bool = False) -> tuple[torch.Tensor, ...]:
        """(row loss sums, row target counts). ``chunked``: from the model's chunked loss, as in training: the whole
        batch's logits (eval rows x seq x vocab, often more rows than a training micro-batch) would not fit where
        only the chunked loss made training fit."""
        return self.forward_rows(model, batch, chunked)

    def eval_metrics(self, rows: list[tuple[torch.Tensor, ...]]) -> dict:
        loss_sum = sum(r[0].double().sum() for r in rows)
        targets = int(sum(r[1].sum() for r in rows))
        loss = float(loss_sum / max(targets, 1))
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "eval_tokens": targets}
