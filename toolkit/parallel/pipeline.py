"""Pipeline parallelism: a Hugging Face causal LM cut by hand into stages, run by ``torch.distributed.pipelining``.

The tracer route (``pipeline()``, accelerate's ``prepare_pippy``) fails on HF models with rotary embeddings, so each
stage is a module of this file holding its slice of the loaded model (docs/strategies.md#pipeline-parallelism):

    first stage: the embeddings + the first decoder layers;  last stage: the last layers + the final norm + the head

The ranks form a (dp, pp) mesh, pp innermost: rank = dp_index * pp + stage rank. The ranks of one pipeline take the
same rows (the loop counts them once: ``distributed.data_parallel_size`` is world / pp). One optimizer step is one
``schedule.step`` over this rank's ``gradient_accumulation_steps`` micro-batches (the pipeline's micro-batches),
whose loss is each micro-batch's summed token loss / the target tokens of the WHOLE global batch
(``scale_grads=False``), so the micro-batch losses add up to the one-process loss (``toolkit.loss``). Then:

  - the replicas of a stage (dp > 1) sum their gradients (an all-reduce over the stage's dp group);
  - a tied embedding (GPT-2, SmolLM2) lives on the first stage (the embedding) and the last (the head): its two
    gradients are summed by an all-reduce between those two ranks, so both copies take the same step;
  - the gradient norm is the norm over all stages (the tied weight counted once): an all-reduce over the pp group,
    then the same clip on every rank.

Padded rows: the attention mask travels with each micro-batch to every stage (a keyword argument of the stage
forward), and each stage builds each layer's mask from it as the model does (causal, or a sliding window:
Mistral's, Qwen2's sliding layers). Padding-free packing is refused.
Every micro-batch of a step is padded to the step's longest row; the stages are set up anew when that length changes.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from toolkit.errors import ConfigError
from toolkit.loss import IGNORE_INDEX, token_losses

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}
LLAMA_FAMILY = ("llama", "mistral", "qwen2")  # SmolLM2 is a Llama
SUPPORTED = "Llama, Mistral, Qwen2, SmolLM2 (model_type llama) and GPT-2"


def family(model) -> str:
    """'llama' or 'gpt2' (how a stage runs its layers); anything else is refused, naming what is supported."""
    kind = getattr(model.config, "model_type", None)
    if kind in LLAMA_FAMILY:
        return "llama"
    if kind == "gpt2":
        return "gpt2"
    raise ConfigError("pipeline_parallel_size", f"pipeline parallelism supports {SUPPORTED} causal LMs; this model "
                                                f"is {kind!r}: train it with pipeline_parallel_size 1")


def _parts(model, kind: str) -> tuple[list, list[nn.Module], list]:
    """(embedding modules, decoder layers, final modules) of a causal LM."""
    if kind == "llama":
        return [model.model.embed_tokens], list(model.model.layers), [model.model.norm, model.lm_head]
    t = model.transformer
    return [t.wte, t.wpe, t.drop], list(t.h), [t.ln_f, model.lm_head]


def _size(modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _check_layers(stages: int, layers: int | None) -> None:
    """Every stage holds at least one whole decoder layer (``cut``; from a model's config before its weights load)."""
    if layers is not None and layers < stages:
        raise ConfigError("pipeline_parallel_size", f"{stages} stages need at least {stages} decoder layers; the model "
                                                    f"has {layers}: lower pipeline_parallel_size or "
                                                    "pipeline_stages_per_rank")


def cut(model, stages: int) -> list[range]:
    """Whole decoder layers per stage, balanced by parameters (the embedding counts on the first stage, the final
    norm and the head on the last; a tied head counts too: it is a copy there). Greedy: each stage closes when the
    running sum reaches its share of the total. Every stage gets at least one layer."""
    embed, layers, final = _parts(model, family(model))
    _check_layers(stages, len(layers))
    weights = [_size(embed) + _size([layers[0]])] + [_size([m]) for m in layers[1:]]
    weights[-1] += sum(p.numel() for m in final for p in m.parameters())  # counted even when tied
    total, bounds, running, start = sum(weights), [], 0, 0
    for i, w in enumerate(weights):
        running += w
        left_layers, left_stages = len(layers) - i - 1, stages - len(bounds) - 1
        if left_stages and (running >= total * (len(bounds) + 1) / stages or left_layers == left_stages):
            bounds.append(range(start, i + 1))
            start = i + 1
    bounds.append(range(start, len(layers)))
    return bounds


def stage_parameters(model, stages: int) -> list[int]:
    """Parameters each stage holds under ``cut`` (a tied head counted again on the last stage: it is a copy there);
    ``toolkit plan`` reads it from a model on the meta device."""
    embed, layers, final = _parts(model, family(model))
    held = [sum(_size([layers[i]]) for i in bounds) for bounds in cut(model, stages)]
    held[0] += _size(embed)
    held[-1] += sum(p.numel() for m in final for p in m.parameters())
    return held


def _attention_types(config) -> list[str]:
    """Each decoder layer's attention, as the model's own forward picks its mask: Qwen2's ``layer_types``; Mistral's
    sliding window on every layer when ``sliding_window`` is set; full causal attention otherwise (Llama, GPT-2)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    return ["sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"] * n


class Stage(nn.Module):
    """One stage: forward(ids or hidden states, attention_mask) -> hidden states (the last stage: logits)."""

    def __init__(self, model, kind: str, layers: range, first: bool, last: bool):
        super().__init__()
        embed, all_layers, final = _parts(model, kind)
        self.kind, self.config, self.first, self.last = kind, model.config, first, last
        self.embed = nn.ModuleList(embed if first else [])
        self.layers = nn.ModuleList(all_layers[i] for i in layers)
        self.final = nn.ModuleList(final if last else [])
        # rotary embeddings hold buffers only (no parameters): every Llama stage computes its own
        self.rotary = model.model.rotary_emb if kind == "llama" else None
        self.attention_types = [_attention_types(model.config)[i] for i in layers]

    def _masks(self, h: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> dict:
        """The mask each attention type of this stage's layers takes, as the whole model builds them (a sliding
        window's too: Mistral's, Qwen2's sliding layers)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        build = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {kind: build[kind](config=self.config, inputs_embeds=h, attention_mask=attention_mask, cache=None,
                                  position_ids=positions) for kind in set(self.attention_types)}

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if self.first:
            h = self.embed[0](x)
            if self.kind == "gpt2":  # GPT2Model: token + position embeddings, then dropout
                h = self.embed[2](h + self.embed[1](positions))
        else:
            h = x
        masks = self._masks(h, attention_mask, positions)
        if self.kind == "llama":
            rope = self.rotary(h, position_ids=positions)
            for layer, kind in zip(self.layers, self.attention_types):
                h = layer(h, attention_mask=masks[kind], position_embeddings=rope, position_ids=positions,
                          use_cache=False)
        else:
            for layer in self.layers:
                h = layer(h, None, masks["full_attention"], use_cache=False, position_ids=positions)
        h = h[0] if isinstance(h, tuple) else h
        for module in self.final:
            h = module(h)
        return h


class PipelineModel(nn.Module):
    """This rank's stages of one pipeline, the schedules that run them, and the whole model's names (for export)."""

    def __init__(self, model, mesh, schedule: str, stages_per_rank: int, micro_batches: int, fsdp: bool = False):
        super().__init__()
        kind = family(model)
        self.pp, self.dp = mesh["pp"].size(), mesh["dp"].size()
        self.pp_group, self.dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        self.pp_rank, self.schedule_name, self.micro_batches = mesh["pp"].get_local_rank(), schedule, micro_batches
        self.n_stages = self.pp * stages_per_rank
        self.stage_ids = [self.pp_rank + self.pp * v for v in range(stages_per_rank)]  # looped, as torch's schedules
        bounds = cut(model, self.n_stages)
        self.stage_modules = nn.ModuleList(Stage(model, kind, bounds[s], s == 0, s == self.n_stages - 1)
                                           for s in self.stage_ids)
        kept = {id(p) for p in self.stage_modules.parameters()}
        # every parameter's shape, by the whole model's name (tied weights once), before the other stages' go: the
        # order of a one-process run's optimizer, which a checkpoint's is numbered in (toolkit.checkpointing.staged)
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        for p in model.parameters():  # the other stages' weights are not this rank's to hold (their names stay)
            if id(p) not in kept:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.fsdp = fsdp
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight  # before any sharding
        modules = {id(m): n for n, m in model.named_modules()}
        # the export's two names of the tied weight (the embedding's, the head's): one tensor again on save
        self.tie_names = tuple(f"{modules[id(m)]}.weight" for m in (model.get_input_embeddings(),
                                                                     model.get_output_embeddings())) if tied else None
        if fsdp:
            _shard(self.stage_modules, mesh["dp"])
        self.bounds, self.config = bounds, model.config
        object.__setattr__(self, "whole_model", model)  # not a submodule: its other stages' weights are not ours
        self.ranks = dist.get_process_group_ranks(self.pp_group)  # global rank of each stage rank
        self.tied = self._tied_parameter(tied)
        self.tie_group = _tie_group(mesh) if self.tied is not None else None
        self.device, self._schedules, self._step = next(model.parameters()).device, {}, {}
        # (name, parameter) as the optimizer holds them: FSDP2's sharded parameters, which a module shows only
        # between steps (after a forward without backward, the evaluation's, the root keeps its gathered ones)
        self.named_parameters_by_model = list(self.named_by_model())

    def _tied_parameter(self, tied: bool):
        """The embedding shared with the head as this rank's stage holds it (the first stage: the embedding; the
        last: the head; FSDP2's sharded parameter where it sharded it); None on the other ranks, or when untied."""
        if not tied:
            return None
        for s, stage in zip(self.stage_ids, self.stage_modules):
            if s == 0:
                return stage.embed[0].weight
            if s == self.n_stages - 1:
                return stage.final[-1].weight
        return None

    # ------------------------------------------------------------------------------------------- training
    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        micro_sum = token_losses(logits, labels)[0].sum()
        self._step["sums"].append(micro_sum.detach().double())
        # FSDP2 averages the replicas' gradients (x 1/dp); the replicas of a DDP-like pipeline are summed instead
        scale = self.dp if self.fsdp else 1
        return micro_sum * scale / self._step["targets"].clamp(min=1)

    def _schedule(self, length: int):
        """The stages and schedule for rows of ``length`` tokens (torch infers the shapes sent between stages once
        per stage object). Only the current length's are held: each stage object keeps its micro-batches' receive
        buffers, so padded rows of many lengths would hold one set of activations per length seen (a new length costs
        one shape inference: the stages' forward on the meta device, and its shapes sent on)."""
        if length not in self._schedules:
            from torch.distributed import pipelining

            self._schedules.clear()

            stages = [pipelining.PipelineStage(module, s, self.n_stages, self.device, group=self.pp_group)
                      for module, s in zip(self.stage_modules, self.stage_ids)]
            cls = getattr(pipelining, SCHEDULES[self.schedule_name])
            args = dict(n_microbatches=self.micro_batches, loss_fn=self._loss, scale_grads=False)
            self._schedules[length] = cls(stages if self.schedule_name == "interleaved_1f1b" else stages[0], **args)
        return self._schedules[length]

    def forward_backward(self, micro_batches: list[dict], global_targets: torch.Tensor) -> torch.Tensor:
        """The pipeline's forward and backward over this rank's micro-batches; returns the step's summed token loss
        (every stage rank gets it from the last stage)."""
        ids, mask, labels = _stack(micro_batches, self.device, self._common_length(micro_batches))
        self._step = {"targets": global_targets.to(self.device), "sums": []}
        schedule = self._schedule(ids.shape[1])
        first = 0 in self.stage_ids
        schedule.step(*([ids] if first else []), target=labels, losses=[], attention_mask=mask)
        # The micro-batches' sums are the last ones: a new stage first infers its shapes on empty tensors, through
        # the loss too.
        loss_sum = sum(self._step["sums"][-self.micro_batches:], torch.zeros((), dtype=torch.float64))
        loss_sum = loss_sum.to(self.device)
        dist.broadcast(loss_sum, src=self.ranks[(self.n_stages - 1) % self.pp], group=self.pp_group)
        return loss_sum

    def _common_length(self, batches: list[dict]) -> int:
        """The longest row of the step over every replica: under FSDP2 the replicas of a stage gather its weights
        together, so they must run the same forwards, and a new row length sets a stage up (one more forward)."""
        length = torch.tensor(max(b["input_ids"].shape[1] for b in batches), device=self.device)
        if self.dp > 1:
            dist.all_reduce(length, op=dist.ReduceOp.MAX, group=self.dp_group)
        return int(length)

    def reduce_and_clip(self, max_grad_norm: float) -> torch.Tensor:
        """Sum the gradients of the stage's replicas and of the tied embedding's two copies; clip to the norm over all
        stages. Returns that pre-clip norm (the same on every rank)."""
        params = [p for p in self.parameters() if p.grad is not None]
        if self.dp > 1 and not self.fsdp:  # (FSDP2 reduce-scattered them in the last backward)
            for p in params:
                dist.all_reduce(p.grad, group=self.dp_group)
        if self.tied is not None and self.tied.grad is not None:  # the same shard on both stages under FSDP2
            dist.all_reduce(_local(self.tied.grad), group=self.tie_group)
        counted = [p for p in params if p is not self.tied or 0 in self.stage_ids]  # the tied weight counted once
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in counted:
            squares += (_local(p.grad).double() ** 2).sum()
        # over the stages; under FSDP2 over the shards too (every rank holds its own)
        dist.all_reduce(squares, group=None if self.fsdp else self.pp_group)
        norm = squares.sqrt().float()
        if max_grad_norm > 0:  # torch's clip_grad_norm_: max_norm / (norm + 1e-6), at most 1
            scale = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
            for p in params:
                p.grad.mul_(scale.to(p.grad.dtype))
        return norm

    # ------------------------------------------------------------------------------------------ evaluation
    def _forward_stages(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The pipeline's forward only, the stages in turn (no micro-batching): the last stage's output on its rank,
        None on the others. Under FSDP2 each stage's forward gathers its weights from the stage's replicas."""
        h, dtype = None, next(self.whole_model.parameters()).dtype
        for s in range(self.n_stages):
            owner, prev = s % self.pp, (s - 1) % self.pp
            if owner == self.pp_rank:
                if s > 0 and prev != self.pp_rank:
                    h = torch.empty(*ids.shape, self.config.hidden_size if hasattr(self.config, "hidden_size")
                                    else self.config.n_embd, dtype=dtype, device=self.device)
                    dist.recv(h, src=self.ranks[prev], group=self.pp_group)
                h = self.stage_modules[self.stage_ids.index(s)](ids if s == 0 else h, mask)
                if s < self.n_stages - 1 and (s + 1) % self.pp != self.pp_rank:
                    dist.send(h.contiguous(), dst=self.ranks[(s + 1) % self.pp], group=self.pp_group)
        return h if self.n_stages - 1 in self.stage_ids else None

    @torch.no_grad()
    def eval_rows(self, batch: dict, task) -> tuple:
        """The task's eval rows of ``batch``, computed on the last stage and sent to every rank of the pipeline."""
        ids, mask, labels = _stack([batch], self.device)
        logits = self._forward_stages(ids, mask)
        rows = [None]
        if logits is not None:
            rows = [tuple(t.cpu() for t in task.eval_rows(lambda **_: SimpleNamespace(logits=logits),
                                                           {**batch, "labels": labels}))]
        dist.broadcast_object_list(rows, src=self.ranks[(self.n_stages - 1) % self.pp], group=self.pp_group)
        return rows[0]

    @torch.no_grad()
    def _forward_nothing(self) -> None:
        """A forward of one token that evaluates nothing: a replica with fewer eval batches than another still joins
        the stage's FSDP2 gathers of every batch."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self._forward_stages(ids, torch.ones_like(ids))

    def evaluate_rows(self, eval_dl, task) -> list[tuple]:
        """Every eval batch's rows from every data-parallel replica (each took its own share of the rows, possibly
        none). Under FSDP2 each forward is a collective of the stage's replicas: they agree on the number of
        forwards BEFORE the first (the most batches of any replica), and a replica out of batches runs forwards that
        evaluate nothing; gathering after its own forwards would pair one replica's gathers with another's count."""
        self.eval()
        batches = list(eval_dl)
        forwards = len(batches)
        if self.fsdp and self.dp > 1:
            most = torch.tensor(len(batches), device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.dp_group)
            forwards = int(most)
        rows = [self.eval_rows(batch, task) for batch in batches]
        for _ in range(forwards - len(batches)):
            self._forward_nothing()
        if self.fsdp:  # a forward without backward leaves each stage's root gathered: sharded again, as in training
            for stage in self.stage_modules:
                stage.reshard()
        self.train()
        if self.dp > 1:
            gathered = [None] * self.dp
            dist.all_gather_object(gathered, rows, group=self.dp_group)
            rows = [r for part in gathered for r in part]
        return rows

    # ---------------------------------------------------------------------------------------------- export
    def gather_state_dict(self) -> dict:
        """Collective: the whole model's state dict on the first rank (by the model's own names), the stages' weights
        gathered there; {} elsewhere."""
        # FSDP2's shards gathered by every replica of the stage (collective), then sent by the first replica
        full = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
                for name, p in self.named_by_model()}
        mine = full if self.mesh_dp_rank() == 0 else {}
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)  # to the first rank only: one copy of the model in flight
        if dist.get_rank() != 0:
            return {}
        state = {}
        for part in gathered:
            state.update(part)
        if self.tie_names:  # the first stage's copy (both took the same steps), under both names
            state[self.tie_names[1]] = state[self.tie_names[0]]
        for name, value in self.whole_model.state_dict().items():  # buffers (not trained)
            if name not in state:
                state[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu()
        return state

    def named_by_model(self):
        """(the whole model's name, parameter) of this rank's stages. By module: FSDP2 swaps a module's parameter
        objects (sharded, gathered), never the module."""
        modules = {id(m): n for n, m in self.whole_model.named_modules(remove_duplicate=False)}
        seen = set()
        for stage in self.stage_modules:
            for module in stage.modules():
                for local, p in module.named_parameters(recurse=False):
                    if id(module) in modules and id(p) not in seen:
                        seen.add(id(p))
                        yield f"{modules[id(module)]}.{local}".lstrip("."), p

    def mesh_dp_rank(self) -> int:
        return dist.get_rank() // self.pp


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) gradient; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _shard(stages: nn.ModuleList, dp_mesh) -> None:
    """FSDP2 over the stage's replicas: each decoder layer a unit, then the stage (its embedding, norm and head)."""
    from torch.distributed.fsdp import fully_shard

    for stage in stages:
        for layer in stage.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(stage, mesh=dp_mesh)


def _tie_group(mesh):
    """The group of the first and last stage ranks of this rank's pipeline (every rank creates every such group)."""
    ranks = mesh.mesh.tolist()  # [dp][pp]
    mine = None
    for row in ranks:
        group = dist.new_group([row[0], row[-1]])
        if dist.get_rank() in (row[0], row[-1]):
            mine = group
    return mine


def _stack(micro_batches: list[dict], device, length: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The micro-batches as one batch (ids, attention mask, labels), each padded on the right to the longest (or to
    ``length``)."""
    length = max(length, *(b["input_ids"].shape[1] for b in micro_batches))

    def pad(t, value):
        return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value)

    ids = torch.cat([pad(b["input_ids"], 0) for b in micro_batches]).to(device)
    mask = torch.cat([pad(b.get("attention_mask", torch.ones_like(b["input_ids"])), 0) for b in micro_batches])
    labels = torch.cat([pad(b["labels"], IGNORE_INDEX) for b in micro_batches])
    return ids, mask.to(device), labels.to(device)


class ReplicaBatches:
    """A data-parallel replica's micro-batches of a ``GlobalBatchSampler`` (which deals micro-batch i to replica
    i % dp): every stage rank of one pipeline takes the same rows."""

    def __init__(self, sampler, dp: int, index: int):
        self.sampler, self.dp, self.index = sampler, dp, index

    def __iter__(self):
        for i, rows in enumerate(self.sampler):
            if i % self.dp == self.index:
                yield rows

    def __len__(self) -> int:
        return len(self.sampler) // self.dp


def check_task(task, model) -> None:
    """What runs under pipeline parallelism is a causal LM (plain text or chat SFT), fully trained (a model handed to
    ``train`` directly; a recipe's run was checked before its data and weights loaded: ``check_run``)."""
    from toolkit.models import lora

    _check(lora.is_peft_model(model), task, model.config)


def check_run(cfg, task, model_config) -> None:
    """Before the data is tokenized and the weights load (``toolkit.training.build.check_inputs``, also in ``toolkit train``'s
    own process): a pipeline run's task, LoRA and architecture, from the config alone."""
    if cfg.train.pipeline_parallel_size > 1:
        _check(cfg.model.use_peft, task, model_config)
        _check_layers(cfg.train.pipeline_parallel_size * cfg.train.pipeline_stages_per_rank,
                      getattr(model_config, "num_hidden_layers", None))


def _check(peft: bool, task, model_config) -> None:
    if peft:
        raise ConfigError("use_peft", "LoRA under pipeline parallelism is not supported yet: train the adapter with "
                                      "pipeline_parallel_size 1 (DDP, FSDP or ZeRO shard what LoRA leaves)")
    if task.name not in ("causal-lm", "chat-sft"):
        raise ConfigError("pipeline_parallel_size", f"the {task.name} task is not supported under pipeline "
                                                    "parallelism yet (causal LM and chat SFT are): use "
                                                    "pipeline_parallel_size 1")
    family(SimpleNamespace(config=model_config))


def build(accelerator, args, model, train_dataset, eval_dataset, sampler, collator):
    """The pipeline's model (this rank's stages) and its loaders: (model, train loader, eval loader or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.data import DataLoader

    pp = args.pipeline_parallel_size
    dp = accelerator.num_processes // pp
    mesh = init_device_mesh(accelerator.device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    if accelerator.mixed_precision == "fp16":
        raise ConfigError("mixed_precision", "fp16 loss scaling is not supported under pipeline parallelism: use bf16 "
                                             "or no mixed precision")
    staged = PipelineModel(model, mesh, args.pipeline_schedule, args.pipeline_stages_per_rank,
                           args.gradient_accumulation_steps, fsdp=accelerator.distributed_type.value == "FSDP")
    replica = mesh["dp"].get_local_rank()
    train_dl = DataLoader(train_dataset, batch_sampler=ReplicaBatches(sampler, dp, replica), collate_fn=collator,
                          num_workers=args.dataloader_num_workers)
    eval_dl = None
    if eval_dataset is not None and len(eval_dataset) > 0:  # on every rank, even where its share is empty
        eval_dl = DataLoader(eval_dataset.select(replica_rows(len(eval_dataset), dp, replica)),
                             batch_size=args.per_device_eval_batch_size, shuffle=False, collate_fn=collator,
                             num_workers=args.dataloader_num_workers)
    return staged, train_dl, eval_dl


def replica_rows(rows: int, replicas: int, index: int) -> range:
    """The eval rows of data-parallel replica ``index``: consecutive, the shares differing by one row at most (a share
    of ceil(rows / replicas) left the last replicas past the end: 9 rows over 4 replicas, 3 + 3 + 3 + an out-of-range
    start); empty where there are fewer rows than replicas, its start still a row of the set (``Dataset.select``
    refuses a range starting past the end, even an empty one). The replica with an empty share evaluates nothing and
    still joins every collective of the evaluation."""
    return range(index * rows // replicas, (index + 1) * rows // replicas)
