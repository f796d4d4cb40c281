"""Preference optimisation (DPO): pairs of completions to one prompt, the chosen one to be preferred to the rejected
one, relative to a frozen reference model.

Data: TRL's preference format, columns ``prompt``, ``chosen``, ``rejected``, either plain text (a completion follows
its prompt; the tokenizer's EOS is appended, as TRL does) or conversational (lists of messages, rendered with the chat
template). Either way ``prompt + completion`` is tokenized once, as chat SFT tokenizes a chat (``toolkit.chat``:
``tokenize_chat``, ``tokenize_spans``), and the completion's tokens (an assistant turn with its end-of-turn token; a
text completion and its EOS) are the targets. A row is a *pair*: its chosen and rejected sequences are collated into
the same micro-batch (chosen rows first, then rejected, one forward), so they stay on one rank and one micro-step.
Rows are truncated to ``block_size`` keeping their start; a prompt that leaves either completion no token within
``block_size`` is refused (naming the row), where TRL would train the pair as a tie.

Loss (``loss_type: sigmoid``, TRL's default and the DPO paper's), per pair, with log-probabilities *summed* over the
completion's tokens (p: the policy's, r: the reference's):

    loss = -logsigmoid(beta * ((p_chosen - r_chosen) - (p_rejected - r_rejected)))

``loss_type: ipo`` (TRL's IPO, its length-normalised form), with n the completion's token count:

    loss = ((p_chosen - r_chosen) / n_chosen - (p_rejected - r_rejected) / n_rejected - 1 / (2 beta))**2

A pair is the target the core normalises by (``num_targets``): each micro-step backpropagates its pairs' summed loss
divided by the global batch's pair count, so the objective is the mean over every pair of the global batch whatever
its split over ranks and micro-steps. (TRL averages each micro-batch and divides by the accumulation steps: a mean of
micro-batch means, the same only when every micro-batch holds as many pairs; docs/pitfalls.md.)

Reference (``toolkit.reference``): by default a live frozen copy of the starting weights (or
``ref_model_name_or_path``), sharded like the policy, evaluated beside it on every micro-batch without grad; with
``use_peft`` the policy with its adapter disabled. With ``precompute_ref_log_probs`` (TRL's name) the starting weights
are evaluated once before training from a whole copy loaded for it and freed (``add_reference``; the policy itself may
already be partitioned under ZeRO-3): every rank computes the log-probabilities of every pair in fixed chunks of
``per_device_eval_batch_size`` pairs in dataset order (so the values do not depend on the world size or the
micro-batch), and they travel with the rows (``ref_chosen_logps``, ``ref_rejected_logps``). Both give the same run.

Metrics on the held-out pairs, named as TRL's evaluation names them: ``eval_rewards/chosen`` and
``eval_rewards/rejected`` (beta x log-ratio), ``eval_rewards/accuracies`` (the share of pairs whose chosen reward is
higher), ``eval_rewards/margins``, ``eval_logps/chosen``, ``eval_logps/rejected``, ``eval_logits/chosen`` and
``eval_logits/rejected`` (the mean logit over the vocabulary, averaged over the
completions' tokens), and ``eval_loss`` (the mean pair loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from datasets import DatasetDict

from toolkit import data
from toolkit.chat import set_chat_template, tokenize_completion  # noqa: F401 (tokenize_completion: its old home)
from toolkit.config import DataArguments
from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX
from toolkit.mixture import load_task_splits
from toolkit.reference import check_reference, fingerprint, load_live, load_whole, reference_kind, reshard
from toolkit.tasks import CausalLM


def unwrap(model):
    """The module under DDP's or DeepSpeed's wrapper (an FSDP2 module is the model itself)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
        return model.module
    return model


COLUMNS = ("prompt", "chosen", "rejected")
SIDES = ("chosen", "rejected")
# A row's keys per side: the chosen sequence under the core's names (what the resume check's data hash and the FLOPs
# estimate read from any task's rows), the rejected one beside it.
KEYS = {"chosen": ("input_ids", "labels"), "rejected": ("rejected_input_ids", "rejected_labels")}
PYDOC_PREFERENCES = "pydoc-preferences"  # the built-in offline set (toolkit.builtin_data.pydoc_preferences)
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def _conversational(value) -> bool:
    return isinstance(value, list)


def load_raw_pairs(args: DataArguments, record: dict | None = None) -> DatasetDict:
    """The splits as prompt/chosen/rejected pairs (``toolkit.formats``: explicit or implicit prompt, all text or all
    conversational), one dataset or a mixture (its rows per set go into ``record["dataset_mixture"]``)."""
    from toolkit.builtin_data import pydoc_preferences

    raw, mixture = load_task_splits(args, "preference", {PYDOC_PREFERENCES: pydoc_preferences})
    if record is not None and mixture is not None:
        record["dataset_mixture"] = mixture
    return raw


def tokenize_pairs(raw: DatasetDict, tokenizer, args: DataArguments, block_size: int) -> DatasetDict:
    """Every pair tokenized (both sides, truncated to ``block_size``, keeping the start); a prompt that leaves a
    completion no token within ``block_size`` is refused, naming the row."""

    def tokenize(batch, indices):
        out = {key: [] for side in SIDES for key in KEYS[side]}
        for prompt, chosen, rejected, index in zip(batch["prompt"], batch["chosen"], batch["rejected"], indices):
            for side, completion in zip(SIDES, (chosen, rejected)):
                ids, labels = tokenize_completion(tokenizer, prompt, completion, f"row {index}, {side}")
                prompt_tokens = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
                if prompt_tokens >= block_size:  # TRL would train it as a tie: both log-probs over no token
                    raise ConfigError("block_size", f"row {index}: the prompt is {prompt_tokens} tokens, so block_size "
                                                    f"{block_size} leaves its {side} completion no token; raise "
                                                    "block_size or remove the pairs with longer prompts")
                out[KEYS[side][0]].append(ids[:block_size])
                out[KEYS[side][1]].append(labels[:block_size])
        return out

    kwargs = {"num_proc": args.preprocessing_num_workers, "load_from_cache_file": not args.overwrite_cache}
    tokenized = data.map_with_tokenizer(raw, tokenize, tokenizer, (block_size,), batched=True, with_indices=True,
                                        desc="tokenize preference pairs", **kwargs)

    def has_targets(batch):  # position i predicts label i+1: a target after the first token, on both sides
        return [all(any(x != IGNORE_INDEX for x in labels[1:]) for labels in pair)
                for pair in zip(batch["labels"], batch["rejected_labels"])]

    kept = tokenized.filter(has_targets, batched=True, desc="drop pairs with no completion token within block_size")
    for name, split in kept.items():
        if len(split) == 0:
            raise ConfigError("block_size", f"no {name} pair has a completion token within block_size {block_size}; "
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

    def __init__(self):
        self.beta, self.loss_type, self.cfg = 0.1, "sigmoid", None  # set from the config by check
        self.reference, self.block_size, self.start = None, None, None  # the live copy (toolkit.reference)
        self.last_eval: dict = {}  # the last evaluation's metrics, for the summary

    def check(self, cfg) -> None:
        if cfg.data.packing or cfg.data.packing_strategy:
            raise ConfigError("packing", "DPO takes one pair per row (its two sequences in one micro-batch); set "
                                         "packing: false and unset packing_strategy")
        cfg.data.packing = False
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
        return tokenize_pairs(raw, tokenizer, args, block_size)

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
        live copy, or from the policy with its adapter disabled (``toolkit.reference``)."""
        if REF_COLUMNS[0] in batch:
            return batch[REF_COLUMNS[0]], batch[REF_COLUMNS[1]]
        if self.reference is not None:
            with self.autocast():  # the policy's prepared forward runs under the launch's mixed precision: so does this
                logps = self.sequence_logps(self.reference, batch, chunked)
            reshard(self.reference)
            return logps
        with unwrap(model).disable_adapter():
            return self.sequence_logps(model, batch, chunked)

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
        from a whole copy on every rank (``reference.load_whole``: outside ZeRO-3's partitioning, before any strategy
        shards the policy, so the same under DDP, ZeRO and FSDP), evaluated, then freed. Otherwise the live reference
        is loaded once the policy is prepared (``prepared``)."""
        self.block_size = parts.block_size
        if reference_kind(cfg) != "precomputed":
            return
        reference = load_whole(cfg, accelerator)
        datasets = self.precompute_reference(reference, {"train": parts.train_dataset, "validation": parts.eval_dataset},
                                             cfg.train.per_device_eval_batch_size, parts.tokenizer.pad_token_id)
        del reference
        parts.train_dataset, parts.eval_dataset = datasets["train"], datasets["validation"]

    def prepared(self, accelerator, model) -> None:
        """The live reference, loaded and sharded as the policy was; its fingerprint before the first step."""
        kind = reference_kind(self.cfg)
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
        return {"reference": out, **last, **self.data_record}

    @torch.no_grad()
    def precompute_reference(self, model, datasets: dict, batch_size: int, pad_token_id: int) -> dict:
        """Each dataset with the starting weights' log-probabilities as two columns (``REF_COLUMNS``), computed in
        chunks of ``batch_size`` pairs in dataset order (the same values on any world size), in eval mode."""
        was_training = model.training
        model.eval()
        collate, out = PairCollator(pad_token_id), {}
        device = next(model.parameters()).device
        for name, split in datasets.items():
            if split is None:
                out[name] = None
                continue
            values = {column: [] for column in REF_COLUMNS}
            for start in range(0, len(split), batch_size):
                batch = collate([split[i] for i in range(start, min(start + batch_size, len(split)))])
                batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                for column, logps in zip(REF_COLUMNS, self.sequence_logps(model, batch)):
                    values[column] += logps.float().cpu().tolist()
            for column in REF_COLUMNS:
                split = split.add_column(column, values[column])
            out[name] = split
        model.train(was_training)
        return out
