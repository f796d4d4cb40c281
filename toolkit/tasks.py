"""What a recipe trains: its data, its model class, the loss of one row and its evaluation metrics.

Everything else (sample order, accumulation, the loss normalisation over the global batch, checkpoints, resume,
export) is the core's, the same for every task. A task answers, for ``toolkit.build`` and ``toolkit.loop``:

    load_raw(data_args)                 the raw splits, columns checked (before any weights load)
    prepare_tokenizer(tokenizer, cfg)   e.g. the chat template (checked before the weights load)
    configure_model(config, tokenizer)  e.g. the labels, set on the config before the weights load
    tokenize(raw, tokenizer, data_args, block_size)   rows the collator takes
    collator(tokenizer)                 pads a micro-batch and counts its targets on the CPU (``num_targets``)
    row_losses(model, batch, chunked)   per-row *summed* loss: the loop divides by the global batch's targets
    eval_rows(model, batch)             per-row tensors for ``gather_for_metrics``; ``eval_metrics`` reduces them

A "target" is what the loss averages over: a next-token prediction for a language model (the prompt's tokens are
not targets in SFT), an example for a classifier. Dividing the summed loss of every micro-batch by the targets of
the whole global batch is what makes N ranks x micro-batch b x accumulation k train like one process with N*b*k.
"""

from __future__ import annotations

import math

import torch

from toolkit import data
from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX, count_targets, token_losses


class CausalLM:
    """Next-token prediction on plain text, packed into ``block_size`` rows or one document per row."""

    name = "causal-lm"
    auto_class = "AutoModelForCausalLM"
    peft_task_type = "CAUSAL_LM"
    best_metric = ("perplexity", min)  # the eval metric whose best value the summary reports, and which is best
    chunkable = True  # loss_chunk_size applies

    def check(self, cfg) -> None:
        """Fields that this task cannot honour, refused before any work."""

    def load_raw(self, args):
        return data.load_raw_datasets(args)

    def prepare_tokenizer(self, tokenizer, cfg) -> None:
        pass

    def configure_model(self, config, tokenizer) -> None:
        pass

    def tokenize(self, raw, tokenizer, args, block_size: int):
        return data.tokenize_and_group(raw, tokenizer, args, block_size)

    def collator(self, tokenizer):
        return data.CausalLMCollator(tokenizer.pad_token_id)

    def count_targets(self, batch: dict) -> torch.Tensor:
        return count_targets(batch["labels"])

    def row_losses(self, model, batch: dict, chunked: bool = False) -> torch.Tensor:
        """Per-row summed token cross-entropy: from the logits, or from the model's chunked loss. ``use_cache=False``:
        a training forward has no use for the key/value cache transformers would otherwise build (Trainer turns it
        off too); the config, and so generation after export, keeps its own setting."""
        if chunked:
            return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"])["row_loss"]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        return token_losses(logits, batch["labels"])[0]

    def eval_rows(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        return token_losses(logits, batch["labels"])  # (row loss sums, row target counts)

    def eval_metrics(self, rows: list[tuple[torch.Tensor, ...]]) -> dict:
        loss_sum = sum(r[0].double().sum() for r in rows)
        targets = int(sum(r[1].sum() for r in rows))
        loss = float(loss_sum / max(targets, 1))
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "eval_tokens": targets}


class ChatSFT(CausalLM):
    """Supervised fine-tuning on chats (``messages``): the loss is on the assistant's turns only, one chat per row
    (no packing: a packed row would let one chat attend to another). ``toolkit.chat`` builds the label mask."""

    name = "chat-sft"

    def check(self, cfg) -> None:
        if cfg.data.packing:
            raise ConfigError("packing", "chat SFT trains one chat per row (packing would let a chat attend to the "
                                         "one before it); set packing: false")

    def load_raw(self, args):
        from toolkit import chat

        return chat.load_raw_chats(args)

    def prepare_tokenizer(self, tokenizer, cfg) -> None:
        from toolkit import chat

        chat.set_chat_template(tokenizer, cfg.data.chat_template)

    def tokenize(self, raw, tokenizer, args, block_size: int):
        from toolkit import chat

        return chat.tokenize_chats(raw, tokenizer, args, block_size)


class SequenceClassification:
    """One label per text (``AutoModelForSequenceClassification``): cross-entropy per example, optionally weighted
    by class; accuracy and macro-F1 on the validation split (``toolkit.classification``)."""

    name = "sequence-classification"
    auto_class = "AutoModelForSequenceClassification"
    peft_task_type = "SEQ_CLS"
    best_metric = ("accuracy", max)
    chunkable = False

    def __init__(self):
        self.labels: list[str] | None = None  # class names, set by load_raw
        self.class_weights: torch.Tensor | None = None

    def check(self, cfg) -> None:
        if cfg.data.packing:
            raise ConfigError("packing", "a classifier takes one text per row; set packing: false")
        if cfg.train.loss_chunk_size:
            raise ConfigError("loss_chunk_size", "the chunked loss is for language models' vocabulary logits; set "
                                                 "loss_chunk_size: 0")

    def load_raw(self, args):
        from toolkit import classification

        raw, self.labels = classification.load_raw_labelled(args)
        self.class_weights = classification.resolve_class_weights(args.class_weights, raw["train"], self.labels)
        return raw

    def prepare_tokenizer(self, tokenizer, cfg) -> None:
        pass

    def configure_model(self, config, tokenizer) -> None:
        from toolkit import classification

        classification.configure_labels(config, self.labels, tokenizer.pad_token_id)

    def tokenize(self, raw, tokenizer, args, block_size: int):
        from toolkit import classification

        return classification.tokenize_labelled(raw, tokenizer, args, block_size)

    def collator(self, tokenizer):
        from toolkit import classification

        return classification.ClassificationCollator(tokenizer.pad_token_id)

    def count_targets(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def row_losses(self, model, batch: dict, chunked: bool = False) -> torch.Tensor:
        from toolkit import classification

        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return classification.row_losses(logits, batch["labels"], self.class_weights)

    def eval_rows(self, model, batch: dict) -> tuple[torch.Tensor, ...]:
        from toolkit import classification

        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return classification.row_losses(logits, batch["labels"], None), logits.argmax(-1), batch["labels"]

    def eval_metrics(self, rows: list[tuple[torch.Tensor, ...]]) -> dict:
        from toolkit import classification

        loss = torch.cat([r[0].double() for r in rows])
        predictions, labels = torch.cat([r[1] for r in rows]), torch.cat([r[2] for r in rows])
        return {"eval_loss": float(loss.mean()) if len(loss) else float("nan"),
                **classification.scores(predictions, labels), "eval_samples": len(labels)}


TASKS = {task.name: task for task in (CausalLM, ChatSFT, SequenceClassification)}
