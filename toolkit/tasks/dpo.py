"""Preference optimisation (DPO): pairs of completions to one prompt, the chosen one to be preferred to the rejected
one, relative to a frozen reference model.

Data: TRL's preference format, columns ``prompt``, ``chosen``, ``rejected``, either plain text (a completion follows
its prompt; the tokenizer's EOS is appended, as TRL does) or conversational (lists of messages, rendered with the chat
template). Either way ``prompt + completion`` is tokenized once, as chat SFT tokenizes a chat (``toolkit.data.chat``:
``tokenize_chat``, ``tokenize_spans``), and the completion's tokens (an assistant turn with its end-of-turn token; a
text completion and its EOS) are the targets. A row is a *pair*: its chosen and rejected sequences are collated into
the same micro-batch (chosen rows first, then rejected, one forward), so they stay on one rank and one micro-step.
Rows are truncated to ``block_size`` keeping their start; a pair whose prompt leaves either completion no token within
``block_size`` is dropped and counted (TRL's rule; ``drop_long_prompts: false`` refuses it, naming the row).

Loss (``loss_type: sigmoid``, TRL's default and the DPO paper's), per pair, with log-probabilities *summed* over the
completion's tokens (p: the policy's, r: the reference's):

    loss = -logsigmoid(beta * ((p_chosen - r_chosen) - (p_rejected - r_rejected)))

``loss_type: ipo`` (TRL's IPO, its length-normalised form), with n the completion's token count:

    loss = ((p_chosen - r_chosen) / n_chosen - (p_rejected - r_rejected) / n_rejected - 1 / (2 beta))**2

A pair is the target the core normalises by (``num_targets``): each micro-step backpropagates its pairs' summed loss
divided by the global batch's pair count, so the objective is the mean over every pair of the global batch whatever
its split over ranks and micro-steps. (TRL averages each micro-batch and divides by the accumulation steps: a mean of
micro-batch means, the same only when every micro-batch holds as many pairs; docs/pitfalls.md.)

Reference (``toolkit.tasks.reference``): by default a live frozen copy of the starting weights (or
``ref_model_name_or_path``), sharded like the policy, evaluated beside it on every micro-batch without grad; with
``use_peft`` the policy with its adapter disabled. With ``precompute_ref_log_probs`` (TRL's name) the starting weights
are evaluated once before training from a whole copy loaded for it and freed (``add_reference``; the policy itself may
already be partitioned under ZeRO-3), on the device: the pairs in fixed chunks of ``per_device_eval_batch_size`` in
dataset order, each rank its share of the chunks, under the run's precision (``accelerator.autocast``, as the live
reference runs), gathered; they travel with the rows (``ref_chosen_logps``, ``ref_rejected_logps``) and are kept in
the run folder for a resume or restart (``toolkit.tasks.reference``). Both give the same run.

Metrics on the held-out pairs, named as TRL's evaluation names them: ``eval_rewards/chosen`` and
``eval_rewards/rejected`` (beta x log-ratio), ``eval_rewards/accuracies`` (the share of pairs whose chosen reward is
higher), ``eval_rewards/margins``, ``eval_logps/chosen``, ``eval_logps/rejected``, ``eval_logits/chosen`` and
``eval_logits/rejected`` (the mean logit over the vocabulary, averaged over the
completions' tokens), and ``eval_loss`` (the mean pair loss).
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import torch
import torch.nn.functional as F
from datasets import DatasetDict

from toolkit import layout
from toolkit.config import LOSS_TYPES, DataArguments
from toolkit.data import loading as data
from toolkit.data.chat import set_chat_template, tokenize_completion
from toolkit.data.mixture import load_task_splits
from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX
from toolkit.parallel.accelerator import unwrap
from toolkit.tasks.lm import CausalLM
from toolkit.tasks.reference import (
    check_reference,
    fingerprint,
    load_live,
    load_whole,
    precomputed_key,
    read_precomputed,
    reference_kind,
    reshard,
    write_precomputed,
)

COLUMNS = ("prompt", "chosen", "rejected")
SIDES = ("chosen", "rejected")
# A row's keys per side: the chosen sequence under the core's names (what the resume check's data hash and the FLOPs
# estimate read from any task's rows), the rejected one beside it.
KEYS = {"chosen": ("input_ids", "labels"), "rejected": ("rejected_input_ids", "rejected_labels")}
PYDOC_PREFERENCES = "pydoc-preferences"  # the built-in offline set (toolkit.data.builtin.pydoc_preferences)
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def _conversational(value) -> bool:
    return isinstance(value, list)


def load_raw_pairs(args: DataArguments, record: dict | None = None) -> DatasetDict:
    """The splits as prompt/chosen/rejected pairs (``toolkit.data.formats``: explicit or implicit prompt, all text or all
    conversational), one dataset or a mixture (its rows per set go into ``record["dataset_mixture"]``)."""
    from toolkit.data.builtin import pydoc_preferences

    raw, mixture = load_task_splits(args, "preference", {PYDOC_PREFERENCES: pydoc_preferences})
    if record is not None and mixture is not None:
        record["dataset_mixture"] = mixture
    return raw


def tokenize_pairs(raw: DatasetDict, tokenizer, args: DataArguments, block_size: int) -> DatasetDict:
    """Every pair tokenized (both sides, truncated to ``block_size``, keeping the start). A pair whose prompt leaves
    a completion no token within ``block_size`` is dropped (TRL's rule), or with ``drop_long_prompts: false``
    refused, naming the row; a split left with no pair is refused."""

    def tokenize(batch, indices):
        out = {key: [] for side in SIDES for key in KEYS[side]}
        for prompt, chosen, rejected, index in zip(batch["prompt"], batch["chosen"], batch["rejected"], indices):
            for side, completion in zip(SIDES, (chosen, rejected)):
                ids, labels = tokenize_completion(tokenizer, prompt, completion, f"row {index}, {side}")
                prompt_tokens = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
                # kept, the pair would train as a tie (both log-probs over no token); dropped by has_targets below
                if prompt_tokens >= block_size and not args.drop_long_prompts:
                    raise ConfigError("block_size", f"row {index}: the prompt is {prompt_tokens} tokens, so block_size "
                                                    f"{block_size} leaves its {side} completion no token; raise "
                                                    "block_size, remove the pairs with longer prompts, or set "
                                                    "drop_long_prompts: true to drop them")
                out[KEYS[side][0]].append(ids[:block_size])
                out[KEYS[side][1]].append(labels[:block_size])
        return out

    kwargs = {"num_proc": args.preprocessing_num_workers, "load_from_cache_file": not args.overwrite_cache}
    tokenized = data.map_with_tokenizer(raw, tokenize, tokenizer, (block_size, args.drop_long_prompts), batched=True,
                                        with_indices=True, desc="tokenize preference pairs", **kwargs)

    def has_targets(batch):  # position i predicts label i+1: a target after the first token, on both sides
        return [all(any(x != IGNORE_INDEX for x in labels[1:]) for labels in pair)
                for pair in zip(batch["labels"], batch["rejected_labels"])]

    kept = tokenized.filter(has_targets, batched=True, desc="drop pairs with no completion token within block_size")
    for name, split in kept.items():
        if len(split) == 0:
            raise ConfigError("block_size", f"none of the {len(tokenized[name])} {name} pairs has a completion token "
                                            f"within block_size {block_size} (their prompts are as long or longer); "
                                            "raise block_size or shorten the prompts")
    return kept


class PairCollator:
    """A micro-batch of pairs as one batch of sequences, chosen rows first then rejected (one forward), right-padded;
    ``num_targets`` is the number of pairs (what the loss is averaged over), counted on the CPU."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict:
        seqs = [r[KEYS[side][0]] for side in SIDES for r in rows]
        labels_in = [r[KEYS[side][1]] for side in SIDES for r in rows]
        ids, mask = data.pad_right(seqs, self.pad_token_id)
        labels = torch.full_like(ids, IGNORE_INDEX)
        for i, row_labels in enumerate(labels_in):
            labels[i, :len(row_labels)] = torch.as_tensor(row_labels, dtype=torch.long)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "num_targets": len(rows),
                 "num_tokens": int(mask.sum()), "num_slots": ids.numel()}
        if REF_COLUMNS[0] in rows[0]:
            for column in REF_COLUMNS:  # float32 -> float -> float32 is exact
                batch[column] = torch.tensor([r[column] for r in rows], dtype=torch.float32)
        return batch


def dpo_losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta: float, loss_type: str,
               lengths: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The loss of each pair (module docstring). ``ipo`` (TRL's): ``(delta - 1 / (2 beta))**2``, where delta is the
    difference of the chosen and rejected log-ratios each divided by its completion's token count (``lengths``)."""
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    if loss_type == "ipo":
        chosen_tokens, rejected_tokens = lengths
        return (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown loss_type {loss_type!r}")


def completion_lengths(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) completion token counts of a micro-batch's pairs (at least 1), what ``ipo`` averages by."""
    return (batch["labels"] != IGNORE_INDEX).sum(dim=1).clamp(min=1).chunk(2)


class DPO(CausalLM):
    """Direct preference optimisation of a causal LM on pairs (module docstring); the reference log-probabilities
    come from the rows (precomputed) or from the reference at each micro-step (``reference_logps``)."""

    name = "dpo"
    sequences_per_row = 2  # chosen and rejected: what the chunked loss sizes its chunk count by
    best_metric = ("eval_loss", min)
    row_unit = "pairs"
    loss_unit = "per pair"  # the DPO loss of a pair (sigmoid: nats; ipo: a squared log-ratio gap), not per token
    stream_refusal = ("it computes every training pair's reference log-probs before step 1 (TRL's "
                      "precompute_ref_log_probs)")
    # TRL's: the policy's log-ratios without dropout noise, as the reference's; TRL's beta and loss
    defaults = {"disable_dropout": True, "beta": 0.1, "loss_type": "sigmoid"}

    def __init__(self):
        self.beta, self.loss_type, self.cfg = 0.1, "sigmoid", None  # set from the config by check
        self.reference, self.block_size, self.start = None, None, None  # the live copy (toolkit.tasks.reference)
        self.last_eval: dict = {}  # the last evaluation's metrics, for the summary
        self.dropped: dict = {}  # pairs dropped per split: the prompt leaves no completion token (drop_long_prompts)

    def check(self, cfg) -> None:
        if cfg.data.packing or cfg.data.packing_strategy:
            raise ConfigError("packing", "DPO takes one pair per row (its two sequences in one micro-batch); set "
                                         "packing: false and unset packing_strategy")
        cfg.data.packing = False
        self.apply_defaults(cfg)  # beta and loss_type, unset: DPO's (the fields are GRPO's too, with other values)
        if cfg.train.beta <= 0:  # beta 0 makes every pair's loss log 2 and its gradient 0: nothing would train
            raise ConfigError("beta", f"must be > 0 for DPO (TRL's default is 0.1), got {cfg.train.beta}")
        if cfg.train.loss_type not in LOSS_TYPES:
            raise ConfigError("loss_type", f"DPO's loss_type is one of {', '.join(LOSS_TYPES)}, got "
                                           f"{cfg.train.loss_type!r} (a GRPO loss: recipes/grpo.py)")
        check_reference(cfg)
        self.beta, self.loss_type, self.cfg = cfg.train.beta, cfg.train.loss_type, cfg

    def load_raw(self, args):
        raw = load_raw_pairs(args, self.data_record)
        self.conversational = len(raw["train"]) > 0 and _conversational(raw["train"][0]["prompt"])
        return raw

    def prepare_tokenizer(self, tokenizer, cfg) -> None:
        if cfg.data.chat_template or getattr(tokenizer, "chat_template", None):
            set_chat_template(tokenizer, cfg.data.chat_template)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token

    def tokenize(self, raw, tokenizer, args, block_size: int):
        if self.conversational and not getattr(tokenizer, "chat_template", None):
            set_chat_template(tokenizer, None)  # refuses: conversational pairs need a template
        pairs = tokenize_pairs(raw, tokenizer, args, block_size)
        self.dropped = {name: len(raw[name]) - len(split) for name, split in pairs.items()}
        return pairs

    def collator(self, tokenizer):
        return PairCollator(tokenizer.pad_token_id)

    def count_targets(self, batch: dict) -> torch.Tensor:
        return torch.tensor(batch["input_ids"].shape[0] // 2)

    def sequence_logps(self, model, batch: dict, chunked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) log-probabilities summed over each completion's tokens: minus the causal LM's per-row
        summed cross-entropy on the completion labels."""
        logps = -super().row_losses(model, batch, chunked)
        return logps.chunk(2)

    @torch.no_grad()
    def reference_logps(self, model, batch: dict, chunked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (chosen, rejected) log-probabilities: carried in the batch when precomputed, else from the
        live copy, or from the policy with its adapter disabled (``toolkit.tasks.reference``)."""
        if REF_COLUMNS[0] in batch:
            return batch[REF_COLUMNS[0]], batch[REF_COLUMNS[1]]
        if self.reference is not None:
            with self.autocast():  # the policy's prepared forward runs under the launch's mixed precision: so does this
                logps = self.sequence_logps(self.reference, batch, chunked)
            reshard(self.reference)
            return logps
        base = unwrap(model)
        was_training = base.training
        base.eval()  # the reference is the frozen base: no dropout in its forward, as a live copy's eval mode
        try:
            with base.disable_adapter():
                return self.sequence_logps(model, batch, chunked)
        finally:
            base.train(was_training)

    def row_losses(self, model, batch: dict, chunked: bool = False) -> torch.Tensor:
        ref_chosen, ref_rejected = self.reference_logps(model, batch, chunked)
        chosen, rejected = self.sequence_logps(model, batch, chunked)
        return dpo_losses(chosen, rejected, ref_chosen, ref_rejected, self.beta, self.loss_type,
                          completion_lengths(batch))

    def eval_rows(self, model, batch: dict, chunked: bool = False) -> tuple[torch.Tensor, ...]:
        """Per pair: the policy's and the reference's (chosen, rejected) log-probabilities, the completions' token
        counts (what ``ipo`` averages by), and the policy's logit sums and target counts (TRL's ``logits/*``)."""
        ref_chosen, ref_rejected = self.reference_logps(model, batch, chunked)
        losses, targets, logit_sums = super().forward_rows(model, batch, chunked, mean_logits=True)
        chosen, rejected = (-losses).chunk(2)
        return (chosen, rejected, ref_chosen, ref_rejected, *completion_lengths(batch), *logit_sums.chunk(2),
                *targets.chunk(2))

    def eval_metrics(self, rows: list[tuple[torch.Tensor, ...]]) -> dict:
        (chosen, rejected, ref_chosen, ref_rejected, *lengths, chosen_logits, rejected_logits, chosen_targets,
         rejected_targets) = (torch.cat([r[i].double() for r in rows]) for i in range(10))
        reward_chosen, reward_rejected = self.beta * (chosen - ref_chosen), self.beta * (rejected - ref_rejected)
        losses = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, self.beta, self.loss_type, lengths)
        # TRL's names as its evaluation logs them: eval_ before each (its training rows have them bare)
        metrics = {"eval_loss": float(losses.mean()), "eval_rewards/chosen": float(reward_chosen.mean()),
                   "eval_rewards/rejected": float(reward_rejected.mean()),
                   "eval_rewards/accuracies": float((reward_chosen > reward_rejected).double().mean()),
                   "eval_rewards/margins": float((reward_chosen - reward_rejected).mean()),
                   "eval_logps/chosen": float(chosen.mean()), "eval_logps/rejected": float(rejected.mean()),
                   # TRL's: the mean logit over the vocabulary, averaged over every completion token (not per pair)
                   "eval_logits/chosen": float(chosen_logits.sum() / chosen_targets.sum().clamp(min=1)),
                   "eval_logits/rejected": float(rejected_logits.sum() / rejected_targets.sum().clamp(min=1)),
                   "eval_pairs": len(losses)}
        self.last_eval = metrics
        return metrics

    def add_reference(self, cfg, accelerator, parts) -> None:
        """With ``precompute_ref_log_probs``: ``parts``' train and eval datasets with the reference log-probabilities,
        read from the run folder when an earlier attempt kept them for the same reference, pairs and precision, else
        computed from a whole copy on the device (``reference.load_whole``: outside ZeRO-3's partitioning, before any
        strategy shards the policy, so the same under DDP, ZeRO and FSDP), each rank its share, and kept there by the
        main process; every rank reads the file. Otherwise the live reference is loaded once the policy is prepared
        (``prepared``)."""
        from accelerate.utils import broadcast_object_list

        self.block_size = parts.block_size
        if reference_kind(cfg) != "precomputed":
            return
        splits = {name: split for name, split in (("train", parts.train_dataset), ("validation", parts.eval_dataset))
                  if split is not None}
        reference = load_whole(cfg, accelerator, parts.block_size)
        key = precomputed_key(reference, {name: pairs_fingerprint(split) for name, split in splits.items()},
                              accelerator, cfg)
        path = layout.reference_logps_file(cfg.train.output_dir, key)
        found = broadcast_object_list([os.path.isfile(path)])[0]  # the main process's answer, on every rank
        if found:
            accelerator.print(f"reference log-probs: reusing {path} (the same reference weights, pairs and precision)")
        else:
            values = self.reference_values(reference, splits, cfg.train.per_device_eval_batch_size,
                                           parts.tokenizer.pad_token_id, accelerator, bool(cfg.train.loss_chunk_size))
            if accelerator.is_main_process:
                write_precomputed(path, values)
            accelerator.print(f"reference log-probs: computed for {', '.join(f'{len(s)} {n}' for n, s in splits.items())}"
                              f" pairs on {accelerator.num_processes} process(es), kept in {path}")
        del reference
        accelerator.wait_for_everyone()  # the file is complete before any rank reads it
        values = read_precomputed(path)
        for name, split in splits.items():
            for column in REF_COLUMNS:
                split = split.add_column(column, values[name][column].tolist())
            splits[name] = split
        parts.train_dataset, parts.eval_dataset = splits["train"], splits.get("validation")

    def prepared(self, accelerator, model) -> None:
        """The live reference, loaded and sharded as the policy was; its fingerprint before the first step."""
        kind = reference_kind(self.cfg)
        if any(self.dropped.values()):
            counts = " and ".join(f"{n} {name}" for name, n in self.dropped.items() if n)
            accelerator.print(f"dropped {counts} pair(s) whose prompt leaves no completion token within block_size "
                              f"{self.block_size} (drop_long_prompts; summary.json's dropped_pairs)")
        if kind == "live":
            self.reference, self.autocast = load_live(self.cfg, accelerator, self.block_size), accelerator.autocast
        if kind != "precomputed":
            self.start = fingerprint(self.reference if kind == "live" else unwrap(model))

    def summary(self, accelerator, model) -> dict:
        """The last evaluation's ``eval_rewards/accuracies`` and ``eval_rewards/margins`` (TRL's names; None without
        evaluation), and ``reference``: its kind and, unless precomputed, each rank's fingerprint of its frozen weights at the start
        and at the end (equal: it never changed) and how many elements that rank holds (sharded: fewer)."""
        kind = reference_kind(self.cfg)
        out = {"kind": kind}
        if kind != "precomputed":
            end = fingerprint(self.reference if kind == "live" else unwrap(model))
            from accelerate.utils import gather_object  # one record per rank; the list as it is on one process

            out["ranks"] = gather_object([{"start": self.start["sha256"], "end": end["sha256"], "numel": end["numel"]}])
        # the last evaluation's reward accuracy and margin
        last = {key: self.last_eval.get(key) for key in ("eval_rewards/accuracies", "eval_rewards/margins")}
        return {"reference": out, **last, **self.data_record, "dropped_pairs": self.dropped}

    def precompute_reference(self, model, datasets: dict, batch_size: int, pad_token_id: int) -> dict:
        """Each dataset (None stays None) with ``model``'s log-probabilities as two columns (``REF_COLUMNS``), in
        this process (``reference_values``)."""
        values = self.reference_values(model, {n: s for n, s in datasets.items() if s is not None}, batch_size,
                                       pad_token_id)
        out = {}
        for name, split in datasets.items():
            for column in REF_COLUMNS if split is not None else ():
                split = split.add_column(column, values[name][column].tolist())
            out[name] = split
        return out

    @torch.no_grad()
    def reference_values(self, model, datasets: dict, batch_size: int, pad_token_id: int, accelerator=None,
                         chunked: bool = False) -> dict:
        """{split: {column: float32 tensor}}: the starting weights' log-probabilities of every pair (``REF_COLUMNS``),
        in eval mode, computed in chunks of ``batch_size`` pairs in dataset order (the same chunks on any world size),
        on the model's device. With ``accelerator``: each rank its contiguous share of the chunks under the run's
        precision (``accelerator.autocast``, as the live reference runs), gathered in rank order (TRL splits its pass
        the same way)."""
        from accelerate.utils import gather_object

        was_training = model.training
        model.eval()
        collate, device = PairCollator(pad_token_id), next(model.parameters()).device
        autocast = accelerator.autocast if accelerator is not None else contextlib.nullcontext
        out = {}
        for name, split in datasets.items():
            starts = list(range(0, len(split), batch_size))
            share = accelerator.split_between_processes(starts) if accelerator else contextlib.nullcontext(starts)
            chunks = []
            with share as mine:
                for start in mine:
                    batch = collate([split[i] for i in range(start, min(start + batch_size, len(split)))])
                    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                    with autocast():
                        logps = self.sequence_logps(model, batch, chunked)
                    chunks.append([x.float().cpu().tolist() for x in logps])  # float32 -> float -> float32: exact
            if accelerator is not None and accelerator.num_processes > 1:
                chunks = gather_object(chunks)  # every rank's chunks, rank 0's first: the dataset's order
            out[name] = {column: torch.tensor([v for chunk in chunks for v in chunk[i]], dtype=torch.float32)
                         for i, column in enumerate(REF_COLUMNS)}
        model.train(was_training)
        return out


def pairs_fingerprint(split) -> str:
    """sha256 of a split's pairs, every token and label of both sides (what the reference's log-probs depend on):
    the key of the precomputed values, so changed data computes them again (``datasets``' own fingerprint is random
    for in-memory data)."""
    import pyarrow.compute as pc

    table = split.select_columns([k for side in SIDES for k in KEYS[side]]).with_format("arrow")[:]
    h = hashlib.sha256(str(len(split)).encode())
    for column in table.column_names:
        values = table.column(column).combine_chunks()
        h.update(column.encode())
        h.update(pc.list_value_length(values).to_numpy(zero_copy_only=False).tobytes())
        h.update(pc.list_flatten(values).to_numpy(zero_copy_only=False).astype("int64").tobytes())
    return h.hexdigest()
