"""Group relative policy optimisation (GRPO, TRL's ``GRPOTrainer``): sample a group of completions per prompt, score
them with reward functions, and push each completion's log-probabilities by its reward against its group's.

Data: TRL's prompt-only format, a ``prompt`` column as text or as messages (rendered with the chat template and its
generation prompt); every other column goes to the reward functions by name (``toolkit.tasks.grpo.rewards``). Prompts stay whole,
as TRL 1.16 keeps them; ``max_prompt_length`` cuts each to its last tokens, and the log and summary.json say how many
prompts and tokens that cut (``prompts_cut``).

A step (``step_batches``, the core's per-step hook, then the core's ``train_step``):

1. The global batch counts *completions*: the sample order (``toolkit.data.order``, ``repeats: num_generations``) lists
   each prompt ``num_generations`` times in a row, so a global batch of B completions holds B / num_generations whole
   groups, split over ranks and micro-batches like any other rows (a group may span them).
2. Each completion slot is sampled with its own generator seeded from (seed, step, prompt index, generation index)
   (``toolkit.tasks.grpo.sampling``): the same completions on any world size, micro-batch or rank, and after a resume. A
   completion ends at the tokenizer's EOS or any EOS id of the model's ``generation_config`` (TRL's: a chat model's
   end of turn); nothing else of that config shapes the draws (the distribution the loss scores).
3. Rewards are computed where the completion is (TRL's call: ``trainer_state``, ``log_metric``, ``log_extra`` with
   the columns; ``async def`` functions awaited together), gathered (every rank the whole global batch's, in slot
   order), and each completion's advantage is its reward against its whole group
   (``toolkit.tasks.grpo.loss.group_advantages``).
4. With ``beta`` > 0 the reference's log-probs (``toolkit.tasks.reference``, as DPO's: a live frozen copy sharded like the
   policy, or with LoRA the adapter disabled), and with ``num_iterations`` > 1 the policy's own (the old policy), are
   taken without grad before the first optimizer step on the batch.

The loss of each ``loss_type`` is TRL's (``toolkit.tasks.grpo.loss``), a row sum over the global batch's targets, so N ranks
x micro b x accumulation k train as one process with N*b*k completions. With ``loss_chunk_size`` every log-prob (the
policy's, the old policy's, the reference's) and the entropy metric come without the micro-batch's logits
(``policy_logps``, ``toolkit.loss.chunked_completion_logps``). ``num_iterations`` > 1: the next
``num_iterations - 1`` optimizer steps reuse the batch (their own prompts are not used); a checkpoint between two
generations holds the batch (``checkpoint_state``: its completions, advantages and old and reference log-probs, made
by weights no checkpoint holds), so a resume at any step trains on what the straight run did.

Metrics, named as TRL logs them: ``reward``, ``reward_std``, ``rewards/<name>/mean`` and ``/std``,
``frac_reward_zero_std``, ``completions/mean_length``, ``/min_length``, ``/max_length``, ``completions/clipped_ratio``,
``completions/mean_terminated_length``, ``/min_terminated_length``, ``/max_terminated_length``, ``entropy``, ``kl``
(beta > 0), ``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean``; and the step's time split,
``time/generation_s`` and ``time/training_s`` (seconds per step; this rank's, the main process's logged), and
``completions/tokens_per_s`` (this rank's generated tokens over its generation time); a reward function's
``log_metric(name, value)``, each generation's mean over every rank. The token means (``entropy``, ``kl``, the clip
ratios) are absent from a row whose window had no completion token in the loss (undefined, not 0). summary.json:
``reward_start``, ``reward_end``, ``train_prompts`` (``train_rows`` counts completions, the run's ``row_unit``),
``zero_std_batches`` of ``generated_batches``, and a warning when every batch's groups had equal rewards (every
advantage 0: nothing learnt).
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from dataclasses import replace

import torch

from toolkit.config import GRPO_LOSS_TYPES, max_positions
from toolkit.data import loading as data
from toolkit.data.chat import set_chat_template
from toolkit.env.launcher import launched_parallel_sizes, launched_strategy
from toolkit.errors import ConfigError
from toolkit.parallel.accelerator import unwrap
from toolkit.tasks.grpo.loss import (
    clip_fractions,
    combine_rewards,
    completion_logps,
    group_advantages,
    nanstd,
    per_token_losses,
    row_losses_and_targets,
)
from toolkit.tasks.grpo.rewards import (
    ARITHMETIC,
    arithmetic_dataset,
    check_signatures,
    check_weights,
    load_reward_funcs,
    score,
    stop,
)
from toolkit.tasks.grpo.sampling import completion_mask, eos_ids, row_seed, sample
from toolkit.tasks.lm import CausalLM
from toolkit.tasks.reference import check_reference, load_live, reference_kind, reshard

INDEX = "prompt_index"  # a prompt's row in the training set: part of each of its completions' seeds
CUT = "prompt_tokens_cut"  # tokenize's count of what max_prompt_length cut from a prompt (dropped after counting)


class GRPO(CausalLM):
    """GRPO on a causal LM (module docstring)."""

    name = "grpo"
    best_metric = ("reward", max)
    row_unit = "completions"
    loss_unit = "GRPO objective"  # the clipped surrogate (near 0 by construction); loss.png draws the mean reward
    stream_refusal = "its sample order lists each prompt num_generations times in a row (toolkit.data.order)"
    defaults = {"disable_dropout": False, "beta": 0.0, "loss_type": "dapo"}  # TRL's GRPOConfig defaults

    def __init__(self):
        self.cfg, self.funcs, self.weights, self.reference = None, [], [], None
        self.cached, self.cached_step = None, None  # the generated batch num_iterations steps reuse
        self.restored = None  # (step, {slot: row}): a checkpoint's generated batch, for a resume at a reuse step
        self.reward_first, self.reward_last = None, None  # a resumed run's, from its checkpoint (summary.json)
        self.window = defaultdict(list)  # per-step metrics since the last log
        self.sums = defaultdict(float)  # masked token sums of the loss's metrics since the last log (this rank)
        self.rewards_seen: list[float] = []  # the mean reward of every generated batch, for the summary
        self.generated_at = None  # when this step's completions were ready (the step's time split)
        self.batches = {"generated": 0, "zero_std": 0}  # generated batches, and those whose every group's std is 0
        self.eos = None  # the ids that end a completion (``toolkit.tasks.grpo.sampling.eos_ids``), once the model is prepared

    # ------------------------------------------------------------------------------------------ checks, data
    def check(self, cfg) -> None:
        self.apply_defaults(cfg)
        args, self.cfg = cfg.train, cfg
        if args.loss_type not in GRPO_LOSS_TYPES:
            raise ConfigError("loss_type", f"GRPO's loss_type is one of {', '.join(GRPO_LOSS_TYPES)}, got "
                                           f"{args.loss_type!r} (a DPO loss: recipes/dpo.py)")
        # the fields of held-out evaluation, block_size and the other fields GRPO does not take are refused by their
        # metadata (toolkit.config.help.unused_field); these are every other task's but some, said here why
        refusals = {"packing": cfg.data.packing, "dataset_mixture": cfg.data.dataset_mixture}
        for field, value in refusals.items():
            if value:
                raise ConfigError(field, "GRPO does not take it here (prompts are whole rows, the loss is over sampled "
                                         "completions, there is no held-out evaluation): unset it")
        cfg.data.packing = False
        if launched_strategy() == "fsdp" and (os.environ.get("FSDP_VERSION", "1") == "1" or cfg.model.use_peft):
            why = ("FSDP1's wrapper has no generate" if os.environ.get("FSDP_VERSION", "1") == "1" else
                   "peft's generate calls the inner model, around FSDP2's root module (torch refuses the forward)")
            raise ConfigError("use_peft" if cfg.model.use_peft else "fsdp_version",
                              f"GRPO generates with model.generate, which does not run here: {why}; launch with "
                              "fsdp.yaml (FSDP2) without LoRA, or ddp.yaml / a ZeRO config")
        if launched_parallel_sizes().get("tp", 1) > 1:
            raise ConfigError("tp_size", "GRPO generates with model.generate per data-parallel rank; tensor "
                                         "parallelism is not supported: launch without it")
        world = int(os.environ.get("WORLD_SIZE", "1"))  # the launch's ranks, before any process group
        batch = args.per_device_train_batch_size * world * args.gradient_accumulation_steps
        if batch % args.num_generations:
            raise ConfigError("num_generations", f"the global batch of {batch} completions ({world} ranks x "
                                                 f"{args.per_device_train_batch_size} x "
                                                 f"{args.gradient_accumulation_steps}) is not a multiple of "
                                                 f"num_generations {args.num_generations}: change one of them")
        if args.beta > 0:
            check_reference(cfg)
        self.funcs = load_reward_funcs(args.reward_funcs, cfg.data.dataset_name)
        self.weights = check_weights(args.reward_weights, self.funcs)

    def sample_repeats(self, cfg) -> int:
        return cfg.train.num_generations

    def load_raw(self, args):
        # every prompt trains: there is no held-out evaluation, so none is split off (validation_split_percentage's
        # 5% of a file's prompts were held out and never used)
        raw = data.load_splits(replace(args, validation_split_percentage=0), {ARITHMETIC: arithmetic_dataset})
        if "prompt" not in raw["train"].column_names:
            raise ConfigError("dataset_name", f"GRPO reads a 'prompt' column (text or messages); the data has "
                                              f"{raw['train'].column_names}")
        # TRL passes every column but the prompt by name: a function that cannot take them stops here, not at step 0
        check_signatures(self.funcs, [c for c in raw["train"].column_names if c != "prompt"])
        self.conversational = len(raw["train"]) > 0 and isinstance(raw["train"][0]["prompt"], list)
        return {"train": raw["train"]}

    def prepare_tokenizer(self, tokenizer, cfg) -> None:
        if cfg.data.chat_template or getattr(tokenizer, "chat_template", None):
            set_chat_template(tokenizer, cfg.data.chat_template)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer = tokenizer

    def tokenize(self, raw, tokenizer, args, block_size: int):
        if self.conversational and not getattr(tokenizer, "chat_template", None):
            set_chat_template(tokenizer, None)  # refuses: conversational prompts need a template
        keep = self.cfg.train.max_prompt_length if self.cfg is not None else None

        def encode(batch, indices):
            ids, cut = [], []
            for prompt in batch["prompt"]:
                if isinstance(prompt, list):
                    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
                    row = tokenizer(text, add_special_tokens=False)["input_ids"]
                else:
                    row = tokenizer(prompt)["input_ids"]
                ids.append(row[-keep:] if keep else row)  # left truncation: the prompt's end stays
                cut.append(len(row) - len(ids[-1]))
            return {"input_ids": ids, INDEX: indices, CUT: cut}

        train = raw["train"].map(encode, batched=True, with_indices=True, desc="tokenize prompts")
        self._count_cut(train[CUT], keep)
        train = train.remove_columns(CUT)  # not a column of the data: the reward functions get the data's own
        self.train_prompts = len(train)  # summary.json's: train_rows counts completions (prompts x num_generations)
        if self.cfg is not None:
            self.check_lengths(train)
        return {"train": train}

    def _count_cut(self, cut: list[int], keep: int | None) -> None:
        """What ``max_prompt_length`` cut, in the log and summary.json (``prompts_cut``): a cut prompt loses its
        start (a system message, the question's first words), which nothing else would show."""
        if keep is None:
            return
        cut_rows = [n for n in cut if n]
        self.data_record["prompts_cut"] = {"prompts": len(cut_rows), "of": len(cut), "tokens_removed": sum(cut_rows),
                                           "max_prompt_length": keep}
        self.log(f"max_prompt_length {keep}: {len(cut_rows)} of {len(cut)} prompts cut to their last {keep} tokens, "
                 f"{sum(cut_rows)} tokens removed" + (f" (at most {max(cut_rows)} from one prompt)" if cut_rows else ""))

    def configure_model(self, config, tokenizer) -> None:
        self.positions = max_positions(config)  # a prompt and its completion must fit (``check_lengths``)

    def check_lengths(self, prompts) -> None:
        """The longest prompt (as kept) and a whole completion within the model's positions, before the weights
        load: past them a position embedding's index fails mid-run."""
        longest = max((len(ids) for ids in prompts["input_ids"]), default=0)
        need = longest + self.cfg.train.max_completion_length
        if getattr(self, "positions", None) and need > self.positions:
            keep = self.cfg.train.max_prompt_length
            fix = ("lower max_prompt_length" if keep else "set max_prompt_length (each prompt keeps its last tokens), "
                   "shorten the prompts") + " or lower max_completion_length to fit"
            raise ConfigError("max_prompt_length", f"the longest prompt {'keeps' if keep else 'has'} {longest} tokens "
                                                   "and a completion takes up to max_completion_length "
                                                   f"{self.cfg.train.max_completion_length}: {need} positions, more "
                                                   f"than the model's {self.positions}; {fix}")

    def collator(self, tokenizer):
        return PromptCollator()

    # ------------------------------------------------------------------------------------------ the step hook
    def prepared(self, accelerator, model) -> None:
        self.accelerator = accelerator
        args = self.cfg.train
        self.eos = eos_ids(unwrap(model), self.tokenizer)
        if args.beta > 0 and reference_kind(self.cfg) == "live":
            self.reference = load_live(self.cfg, accelerator, block_size=0)

    def step_batches(self, accelerator, model, micro_batches: list[dict], step: int) -> list[dict]:
        """The step's prompt micro-batches -> completion micro-batches (module docstring, 1-4); with num_iterations
        > 1, the batch generated at the cycle's first step."""
        mu = self.cfg.train.num_iterations
        self._training_time()  # the previous step's training part, if not yet counted
        if step % mu:
            if self.cached_step != step - step % mu and self.restored and self.restored[0] == step - step % mu:
                self.cached, self.cached_step = self._rebuild(accelerator, micro_batches), self.restored[0]
                self.restored = None
            if self.cached_step != step - step % mu:
                raise ConfigError("num_iterations", f"step {step} reuses the completions generated at step "
                                                    f"{step - step % mu} (num_iterations {mu}), which the checkpoint "
                                                    "does not hold (written with another num_iterations): resume "
                                                    "with the checkpoint's num_iterations")
            self.window["time/generation_s"].append(0.0)
            self.generated_at = time.perf_counter()
            return self.cached
        started = time.perf_counter()
        batches = self._generate(accelerator, model, micro_batches, step)
        self.cached, self.cached_step = batches, step
        self.generated_at = time.perf_counter()
        self.window["time/generation_s"].append(self.generated_at - started)
        self.window["completions/tokens_per_s"].append(sum(int(b["lengths"].sum()) for b in batches)
                                                       / max(self.generated_at - started, 1e-9))
        return batches

    def _training_time(self) -> None:
        """The time from the end of the step's generation to now (its loss, backward and optimizer step: the core's
        train_step), counted once per step into ``time/training_s``."""
        if self.generated_at is not None:
            self.window["time/training_s"].append(time.perf_counter() - self.generated_at)
            self.generated_at = None

    def _slots(self, accelerator, micro: int, k: int) -> list[int]:
        """The positions in the global batch of micro-step k's rows on this rank (``toolkit.data.order``: micro-step
        major, rank minor)."""
        start = (k * accelerator.num_processes + accelerator.process_index) * micro
        return list(range(start, start + micro))

    def _generate(self, accelerator, model, micro_batches, step) -> list[dict]:
        args, tokenizer = self.cfg.train, self.tokenizer
        generator = unwrap(model)
        was_training = generator.training
        generator.eval()  # no dropout in sampling: the completions are the sample order's
        sharded = accelerator.num_processes > 1 and (accelerator.distributed_type.value in ("DEEPSPEED", "FSDP"))
        out, local = [], []
        try:
            for k, batch in enumerate(micro_batches):
                slots = self._slots(accelerator, len(batch["rows"]), k)
                seeds = [row_seed(args.seed, step, r[INDEX], s % args.num_generations)
                         for r, s in zip(batch["rows"], slots)]
                ids, mask = left_pad([r["input_ids"] for r in batch["rows"]], tokenizer.pad_token_id)
                ids, mask = ids.to(accelerator.device), mask.to(accelerator.device)
                completions = sample(generator, ids, mask, seeds, max_new_tokens=args.max_completion_length,
                                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=self.eos,
                                     synced_gpus=sharded)
                out.append({**self._completion_batch(batch, ids, mask, completions), "slots": slots})
                local.append(self._score(batch, out[-1], slots, step))
        finally:
            generator.train(was_training)
        self._advantages(accelerator, out, local)
        self._extra_logps(model, out)
        return out

    def _completion_batch(self, batch, prompt_ids, prompt_mask, completions) -> dict:
        cmask, truncated = completion_mask(completions, self.eos)
        lengths = cmask.sum(1)
        loss_mask = cmask * (~truncated).long().unsqueeze(1) if self.cfg.train.mask_truncated_completions else cmask
        return {"input_ids": torch.cat([prompt_ids, completions], 1), "attention_mask": torch.cat([prompt_mask, cmask], 1),
                "completion_ids": completions, "completion_mask": loss_mask, "prompt_length": prompt_ids.shape[1],
                "lengths": lengths, "truncated": truncated, "rows": batch["rows"]}

    def _score(self, batch, completion_batch, slots, step: int) -> tuple:
        """(slots, rewards per function per completion or None, error, lengths, truncated, the values the functions
        gave ``log_metric``) of one micro-batch."""
        tokenizer, rows = self.tokenizer, batch["rows"]
        ids = [c[:n].tolist() for c, n in zip(completion_batch["completion_ids"].cpu(), completion_batch["lengths"])]
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts
        columns = {c: [r[c] for r in rows] for c in rows[0] if c not in ("input_ids", INDEX, "prompt")}
        logged = defaultdict(list)

        def log_metric(name: str, value: float) -> None:  # TRL's: averaged over the generation, every rank's
            logged[name].append(float(value))

        def log_extra(column: str, values: list) -> None:  # TRL's completions table's columns: no such table here
            pass

        context = {"trainer_state": self._trainer_state(step), "log_metric": log_metric, "log_extra": log_extra}
        rewards, error = score(self.funcs, [r["prompt"] for r in rows], completions, ids, columns, context)
        return (slots, rewards, error, completion_batch["lengths"].tolist(), completion_batch["truncated"].tolist(),
                dict(logged))

    def _trainer_state(self, step: int):
        """TRL's ``trainer_state`` (transformers' ``TrainerState``) at a generation: the optimizer steps done, the
        run's steps, the epoch; for reward functions that shape their reward by the run's progress."""
        from toolkit.env import upstream

        upstream.import_peft()  # trainer_callback imports peft: without bitsandbytes, as the loop's imports do
        from transformers.trainer_callback import TrainerState

        args, per_epoch = self.cfg.train, self.steps_per_epoch
        main = self.accelerator.is_main_process
        return TrainerState(epoch=step / per_epoch if per_epoch else None, global_step=step,
                            max_steps=self.total_steps or 0, logging_steps=args.logging_steps,
                            save_steps=args.save_steps or 0, train_batch_size=args.per_device_train_batch_size,
                            num_train_epochs=math.ceil((self.total_steps or 0) / per_epoch) if per_epoch else 0,
                            is_local_process_zero=self.accelerator.is_local_main_process, is_world_process_zero=main)

    def _advantages(self, accelerator, out: list[dict], local: list[tuple]) -> None:
        """Every rank's scores gathered (the whole global batch, in slot order), each group's advantages, and the
        generation metrics; a reward function's failure stops the run on every rank."""
        from accelerate.utils import gather_object

        parts = gather_object([local]) if accelerator.num_processes > 1 else [local]
        stop([p[2] for rank in parts for p in rank])
        self._logged_metrics([p[5] for rank in parts for p in rank])
        flat = sorted(((slot, [f[i] for f in p[1]], p[3][i], p[4][i]) for rank in parts for p in rank
                       for i, slot in enumerate(p[0])), key=lambda x: x[0])
        per_func = torch.tensor([x[1] for x in flat], dtype=torch.float32)
        rewards = combine_rewards(per_func, self.weights)
        advantages, std = group_advantages(rewards, self.cfg.train.num_generations, self.cfg.train.scale_rewards)
        for batch, mine in zip(out, local):
            positions = torch.tensor(mine[0])
            batch["advantages"] = advantages[positions].to(batch["input_ids"].device)
        self._generation_metrics(per_func, rewards, std, flat)

    def _logged_metrics(self, logged: list[dict]) -> None:
        """The reward functions' ``log_metric`` values of one generation, every rank's: each name's mean (TRL's)."""
        for name in sorted({name for part in logged for name in part}):
            values = [v for part in logged for v in part.get(name, [])]
            self.window[name].append(sum(values) / len(values))

    def _generation_metrics(self, per_func, rewards, std, flat) -> None:
        """TRL's: means and stds over the rewards that are not NaN (a function's None), frac_reward_zero_std of the
        std the advantages were scaled by, the lengths of all completions and of those that ended (0 if none)."""
        w, lengths = self.window, torch.tensor([x[2] for x in flat], dtype=torch.float32)
        w["reward"].append(float(torch.nanmean(rewards)))
        w["reward_std"].append(float(nanstd(rewards)))
        zero_std = torch.isclose(std, torch.zeros_like(std))
        w["frac_reward_zero_std"].append(float(zero_std.float().mean()))
        self.batches["generated"] += 1
        self.batches["zero_std"] += int(bool(zero_std.all()))  # every advantage 0: the batch teaches nothing
        for i, (name, _) in enumerate(self.funcs):
            name = name.split(":")[-1]  # TRL's: the function's name (an import path's last part)
            w[f"rewards/{name}/mean"].append(float(torch.nanmean(per_func[:, i])))
            w[f"rewards/{name}/std"].append(float(nanstd(per_func[:, i])))
        truncated = torch.tensor([bool(x[3]) for x in flat])
        ended = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
        for kind, values in (("length", lengths), ("terminated_length", ended)):
            for stat in ("mean", "min", "max"):
                w[f"completions/{stat}_{kind}"].append(float(getattr(values, stat)()))
        w["completions/clipped_ratio"].append(float(truncated.float().mean()))
        self.rewards_seen.append(float(torch.nanmean(rewards)))

    @torch.no_grad()
    def _extra_logps(self, model, out: list[dict]) -> None:
        """Targets per row; the reference's log-probs (beta > 0) and the old policy's (num_iterations > 1), without
        grad, before the batch's first optimizer step."""
        args = self.cfg.train
        for batch in out:
            self._counts(batch)
            if args.num_iterations > 1:
                batch["old_logps"] = self._logps(model, batch)[0].detach()
            if args.beta > 0:
                batch["ref_logps"] = self._reference_logps(model, batch)

    def _counts(self, batch: dict) -> None:
        """The counts the core's step reads (``toolkit.training.loop._global_counts``), counted where the batch is built."""
        args = self.cfg.train
        _, targets = row_losses_and_targets(torch.zeros(batch["completion_mask"].shape), batch["completion_mask"].cpu(),
                                            args.loss_type, args.max_completion_length)
        batch["num_targets"] = int(targets.sum())
        batch["num_tokens"] = int(batch["attention_mask"].sum())
        batch["num_slots"] = batch["input_ids"].numel()

    def _reference_logps(self, model, batch) -> torch.Tensor:
        if self.reference is not None:
            logps = self._logps(self.reference, batch)[0]
            reshard(self.reference)
            return logps
        base = unwrap(model)
        with base.disable_adapter():
            return self._logps(model, batch)[0]

    # ------------------------------------------------------------------------------------------ the loss
    def _logps(self, model, batch, chunked: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's, the old policy's or the reference's; ``chunked`` (unset: ``loss_chunk_size``) without the
        micro-batch's logits (every model here has the chunked forward then: the policy's, the live reference's)."""
        args = self.cfg.train
        chunked = bool(args.loss_chunk_size) if chunked is None else chunked
        return policy_logps(model, batch, args.temperature,
                            args.per_device_train_batch_size * args.max_completion_length if chunked else None)

    def count_targets(self, batch: dict) -> torch.Tensor:
        return torch.tensor(batch["num_targets"])

    def row_losses(self, model, batch: dict, chunked: bool = False) -> torch.Tensor:
        args = self.cfg.train
        logps, entropy = self._logps(model, batch, chunked)
        eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        token_loss, kl, ratio = per_token_losses(logps, batch.get("old_logps"), batch["advantages"],
                                                 batch.get("ref_logps"), args.beta, args.epsilon, eps_high)
        mask = batch["completion_mask"]
        rows, _ = row_losses_and_targets(token_loss, mask, args.loss_type, args.max_completion_length)
        self._loss_metrics(mask, entropy, kl, ratio, batch["advantages"], args.epsilon, eps_high)
        return rows

    def _loss_metrics(self, mask, entropy, kl, ratio, advantages, eps_low, eps_high) -> None:
        m = mask.float()
        values = {"entropy": entropy, **clip_fractions(ratio, advantages, eps_low, eps_high)}
        if kl is not None:
            values["kl"] = kl * ratio  # as TRL logs it: the bias-corrected KL
        for name, v in values.items():
            self.sums[name] += float((v.detach() * m).sum())
        self.sums["_tokens"] += float(m.sum())

    def eval_rows(self, model, batch: dict, chunked: bool = False):
        raise NotImplementedError("GRPO has no held-out evaluation")

    def eval_metrics(self, rows):
        raise NotImplementedError("GRPO has no held-out evaluation")

    # ------------------------------------------------------------------------------------------ records
    def log_metrics(self) -> dict:
        """Collective (every rank logs at the same steps): the window's metrics, each a mean over its steps; the loss
        metrics' token means over every rank's tokens."""
        self._training_time()
        names = sorted(k for k in self.sums if k != "_tokens")
        totals = torch.tensor([self.sums[k] for k in names] + [self.sums["_tokens"]], dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals.to(self.accelerator.device), reduction="sum").cpu()
        # no completion token in the loss since the last log (every one masked): a token mean is undefined, not 0
        row = {name: float(totals[i] / totals[-1]) for i, name in enumerate(names)} if totals[-1] > 0 else {}
        row.update({k: sum(v) / len(v) for k, v in self.window.items() if v})
        self.window.clear()
        self.sums.clear()
        return row

    def _reward_ends(self) -> tuple:
        """The run's first and latest mean reward: a resumed run's first is its checkpoint's."""
        seen = self.rewards_seen
        first = self.reward_first if self.reward_first is not None else seen[0] if seen else None
        return first, seen[-1] if seen else self.reward_last

    def summary(self, accelerator, model) -> dict:
        start, end = self._reward_ends()
        out = {"reward_start": start, "reward_end": end, "reward_funcs": [name for name, _ in self.funcs],
               "train_prompts": self.train_prompts, "generated_batches": self.batches["generated"],
               "zero_std_batches": self.batches["zero_std"], **self.data_record}
        if self.batches["generated"] and self.batches["zero_std"] == self.batches["generated"]:
            out["warnings"] = [f"every group of completions had equal rewards in all {self.batches['generated']} "
                               "generated batches (reward std 0 in each group): every advantage was 0 and the "
                               "policy learnt nothing; check the reward functions (rewards/<name>/mean in "
                               "metrics.jsonl) against the completions they score"]
        return out

    # ------------------------------------------------------------------------------------------ checkpoints
    def checkpoint_state(self, step: int) -> dict:
        """Collective (every rank, at every checkpoint): the run's first and latest mean reward, and, when the step
        after ``step`` reuses a generated batch (num_iterations > 1), that batch: every rank's rows by their slot in
        the global batch. Its completions were drawn, and its old log-probs taken, by the weights of the batch's
        first step, which no checkpoint holds; with them the resume trains on exactly what the straight run did."""
        from accelerate.utils import gather_object

        start, end = self._reward_ends()
        state = {"reward_start": start, "reward_end": end, "batches": dict(self.batches)}
        mu = self.cfg.train.num_iterations
        if step % mu and self.cached_step == step - step % mu:
            rows = [row for batch in self.cached for row in slot_rows(batch)]
            if self.accelerator.num_processes > 1:
                rows = gather_object(rows)
            state["batch"] = {"step": self.cached_step, "rows": sorted(rows, key=lambda r: r["slot"])}
        return state

    def load_checkpoint_state(self, saved: dict | None) -> None:
        """A resume: what ``checkpoint_state`` wrote (None: a checkpoint without it)."""
        saved = saved or {}
        self.reward_first, self.reward_last = saved.get("reward_start"), saved.get("reward_end")
        self.batches = dict(saved.get("batches") or self.batches)
        if saved.get("batch"):
            self.restored = (saved["batch"]["step"], {row["slot"]: row for row in saved["batch"]["rows"]})

    def _rebuild(self, accelerator, micro_batches: list[dict]) -> list[dict]:
        """This rank's micro-batches of the restored batch (its slots, as ``_generate`` places them): padded as
        generated on the same layout (bit-identical then), re-padded on another."""
        pad, rows_by_slot, out = self.tokenizer.pad_token_id, self.restored[1], []
        for k, batch in enumerate(micro_batches):
            slots = self._slots(accelerator, len(batch["rows"]), k)
            rows = [rows_by_slot[slot] for slot in slots]
            prompt_ids, prompt_mask = left_pad([r["prompt"] for r in rows], pad)
            completions = right_pad([r["completion"] for r in rows], pad, torch.long)
            attention = right_pad([r["attention"] for r in rows], 0, torch.long)
            rebuilt = {"input_ids": torch.cat([prompt_ids, completions], 1),
                       "attention_mask": torch.cat([prompt_mask, attention], 1), "completion_ids": completions,
                       "completion_mask": right_pad([r["mask"] for r in rows], 0, torch.long),
                       "advantages": torch.tensor([r["advantage"] for r in rows], dtype=torch.float32)}
            for key in ("old_logps", "ref_logps"):
                if key in rows[0]:
                    rebuilt[key] = right_pad([r[key] for r in rows], 0.0, torch.float32)
            rebuilt = {key: value.to(accelerator.device) for key, value in rebuilt.items()}
            rebuilt.update(prompt_length=prompt_ids.shape[1], slots=slots)
            self._counts(rebuilt)
            out.append(rebuilt)
        return out


def slot_rows(batch: dict) -> list[dict]:
    """A generated micro-batch as JSON-able rows (``GRPO.checkpoint_state``): the prompt without its padding; the
    completion, its attention and loss masks and its log-probs as padded here (the width ``GRPO._rebuild`` pads
    back to on the same layout)."""
    p, cpu = batch["prompt_length"], {k: v.cpu() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    rows = []
    for i, slot in enumerate(batch["slots"]):
        row = {"slot": slot, "prompt": cpu["input_ids"][i, :p][cpu["attention_mask"][i, :p].bool()].tolist(),
               "completion": cpu["completion_ids"][i].tolist(), "attention": cpu["attention_mask"][i, p:].tolist(),
               "mask": cpu["completion_mask"][i].tolist(), "advantage": float(cpu["advantages"][i])}
        row.update({key: cpu[key][i].tolist() for key in ("old_logps", "ref_logps") if key in cpu})
        rows.append(row)
    return rows


def policy_logps(model, batch: dict, temperature: float,
                 completion_positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token log-probs, entropies) of a batch's completions under ``model``. Positions count a row's own tokens
    (from its mask), as generation counts them: TRL passes none, so a left-padded prompt's positions there depend on
    the longest prompt of its micro-batch (measured on GPT-2: logits 0.54 apart), which would tie a completion's loss
    to the rows it is batched with.

    ``completion_positions`` (``loss_chunk_size``: the most completion tokens a micro-batch holds): from the model's
    chunked forward (``toolkit.models.loading.enable_chunked_loss``), the same values without the micro-batch's logits
    (the prompt's positions are not projected at all)."""
    mask = batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    if completion_positions is not None:
        out = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions,
                    completion_ids=batch["completion_ids"], temperature=temperature,
                    completion_positions=completion_positions)
        return out["token_logps"], out["entropy"]
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions, use_cache=False).logits
    p = batch["prompt_length"]
    return completion_logps(logits[:, p - 1:-1], batch["completion_ids"], temperature)


def left_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded to the longest (generation continues them on the right), and their mask."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


def right_pad(rows: list[list], value, dtype) -> torch.Tensor:
    """Rows right-padded with ``value`` to the longest."""
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=dtype)


class PromptCollator:
    """A micro-batch of prompt rows as they are (``GRPO.step_batches`` turns them into completions); the counts the
    core reads come with the completions."""

    def __call__(self, rows: list[dict]) -> dict:
        return {"rows": rows}
