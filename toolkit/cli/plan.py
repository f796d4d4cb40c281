"""``python -m toolkit plan``: which strategy fits, per device, before a GPU is paid for.

    python -m toolkit plan --model meta-llama/Llama-2-7b-hf --gpus 8 --gpu-memory 80GB [--nodes 2]
        [--micro-batch 4 --seq-len 2048] [--precision bf16] [--lora-r 16 [--lora-target-modules q_proj v_proj]
        [--load-in-4bit [--use-bnb-nested-quant]]] [--gradient-checkpointing]
        [--sequence-parallel-size N | --context-parallel-size N]

The model is counted from its config on the meta device (no weights allocated). Per device and per strategy:

Model states (ZeRO paper, Rajbhandari et al. 2020, section 3.1), bytes per trained parameter with AdamW:

    DeepSpeed (ZeRO-*)   bf16/fp16: 2 weights + 2 gradients + 12 optimizer (fp32 master copy, exp_avg, exp_avg_sq)
                         fp32:      ZeRO-1/2 4 + 4 + 12 (a master copy even of fp32 weights): 20; ZeRO-3 4 + 4 + 8
                         (its fp32 master partition is the weights' own, stage3.py _create_fp32_partitions): 16
    torch (DDP, FSDP2)   4 + 4 + 8 at any precision: accelerate's mixed precision autocasts the compute and keeps
                         the parameters, so the master weights, in fp32

With D data-parallel devices:

    DDP        weights + gradients + optimizer on every device
    ZeRO-1     optimizer / D
    ZeRO-2     (gradients + optimizer) / D
    ZeRO-3     (weights + gradients + optimizer) / D      FSDP2 the same
    ZeRO-3 + offload: optimizer state (and fp32 master weights) in CPU memory; the device holds weights + gradients / D
    HSDP       everything / (devices per node): sharded within a node, replicated across nodes (on one node:
               FSDP2's figures, with dp_replicate_size 1)
    TP         everything / (devices per node), one node only (tp.yaml: TP with data parallelism is refused);
               activations inside attention and the MLP / t too

With ``--optim muon`` (``toolkit.training.optimizers``) Muon's group (the hidden 2-D weights) holds one fp32 momentum
buffer, 4 bytes a parameter instead of AdamW's 8, and each device adds the Newton-Schulz working set of the largest
matrix (fp32, whole; freed after each matrix); under FSDP2, HSDP and TP also the whole matrices it gathers as their
owner rank (about Muon's group / the shard degree, plus three largest matrices: ``muon_gathered``); the ZeRO rows are
refused, as the recipes refuse them.

DPO (``--recipe dpo``): its live reference copy holds weights only, sharded like the policy's (whole under DDP and
ZeRO-1/2, / D under ZeRO-3 and FSDP2); none with ``--lora-r`` (the adapter disabled is the reference) or
``--precompute-ref-log-probs``; under TP a live reference is refused.

With LoRA (``--lora-r``, ``--lora-target-modules``) the base weights are frozen (weights only, sharded like the
weights); the adapters the recipes would train with the same fields (r x (in + out) per adapted layer: peft's default
targets for the model type unless named, e.g. Llama's q_proj and v_proj; counted by peft on the meta model) carry the
16 bytes.

With ``--load-in-4bit`` (QLoRA) the base's linear layers (all but the head) are counted as bitsandbytes holds them:
0.5 byte a weight plus the quantization constants (``toolkit.models.quantization.layer_bytes``); layouts a quantized base is
refused under say so.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4,
16-bit activations; x2 in fp32), per layer, for micro batch b, sequence s, width h, a heads:

    low       34 s b h                  attention without its s x s matrices (flash / SDPA kernels)
    expected  34 s b h + 5 a s^2 b / 2  half of the eager attention matrices (SDPA on some shapes, masks)
    high      34 s b h + 5 a s^2 b      eager attention storing scores, softmax and dropout mask

plus the logits of the whole micro batch, b s V x (4 fp32 + 4 fp32 gradient) bytes (x 0.5 / 1 / 1.5), which
``loss_chunk_size`` removes. With ``--gradient-checkpointing`` each layer keeps only its input (2 s b h) and one
layer's activations are alive again during its recompute; both are printed, the run asked for first. A strategy
fits when model states + high activations are below 90% of the device's memory (CUDA context and fragmentation take
the rest); "maybe" when only the expected do. docs/memory.md has the same, for readers of the docs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

from toolkit.env import hub
from toolkit.errors import ConfigError

GB = 1e9
HEADROOM = 0.9


@dataclass
class ModelCount:
    params: int  # every parameter once (tied ones once)
    trainable: int  # the parameters that get gradients and optimizer state
    layers: int
    width: int
    heads: int
    vocab: int
    # why the model cannot be split over t ranks by its TP plan (toolkit.models.loading.tensor_parallel_problem), or None
    tp_problem: Callable[[int], str | None] = lambda tp: None
    quantized: int = 0  # of ``params``, the weights held quantized (--load-in-4bit / --load-in-8bit)
    quantized_bytes: int = 0  # the bytes they take, quantization constants included
    muon: int = 0  # with --optim muon: of ``trainable``, the parameters in Muon's group (toolkit.training.optimizers)
    muon_transient: int = 0  # bytes of the Newton-Schulz working set of the largest Muon matrix (``_muon_count``)
    muon_largest: int = 0  # the parameters of the largest Muon matrix (what an owner rank gathers whole)
    attention_dropout: bool = False  # above 0 in the config (GPT-2's attn_pdrop): the ring needs disable_dropout

    def weight_bytes(self, per_param: int) -> float:
        """Bytes of every weight: ``per_param`` each, the quantized ones theirs."""
        return per_param * (self.params - self.quantized) + self.quantized_bytes
    # parameters per pipeline stage for P stages (toolkit.parallel.pipeline.stage_parameters), or None where no cut is known
    stage_params: Callable[[int], list[int] | None] = lambda stages: None


def count_model(model: str, lora_r: int | None = None, lora_target_modules: list[str] | None = None,
                quantize_bits: int | None = None, nested: bool = False, optim: str = "adamw_torch") -> ModelCount:
    """Parameters of ``model`` (a Hub name, a folder or a config.json), built on the meta device. With ``lora_r``,
    the adapters the recipes would train with these fields (``lora_target_modules`` None: peft's default for the
    model type, e.g. Llama's q_proj and v_proj), counted by peft itself on the meta model. ``quantize_bits`` 4 or 8:
    the base's linear layers held as bitsandbytes holds them (``toolkit.models.quantization.layer_bytes``; ``nested``:
    double quantization). ``optim`` muon: the parameters of Muon's group, by the optimizer's own rule."""
    import torch
    from transformers import AutoConfig

    from toolkit.reporting.accounting import model_shape

    source = os.path.dirname(model) if model.endswith(".json") else model
    offline = hub.offline_if_unreachable(source)  # at once, not after ~25 s of retries
    try:
        config = AutoConfig.from_pretrained(source)
    except OSError:
        if offline:
            raise OSError(hub.not_cached(source, offline)) from None
        raise
    with torch.device("meta"):
        net = _build(config)
    params = sum(p.numel() for p in net.parameters())  # parameters() yields a tied parameter once
    quantized = quantized_bytes = 0
    if quantize_bits:
        from toolkit.models.quantization import layer_bytes, quantized_layers

        layers = quantized_layers(net)
        quantized = sum(n for n, _ in layers)
        quantized_bytes = sum(layer_bytes(n, quantize_bits, nested, rows) for n, rows in layers)
    trainable = params
    if lora_r:
        trainable = _lora_trainable(net, lora_r, lora_target_modules)
        params += trainable  # the adapters are weights too (held like the base's), and the only ones with state
    layers, width = model_shape(config)
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    # The logits of the micro batch: a causal LM's are vocab wide, a classifier's num_labels wide.
    head = net.get_output_embeddings() if hasattr(net, "get_output_embeddings") else None
    logits = config.vocab_size if head is not None else getattr(config, "num_labels", 2)
    from toolkit.models.loading import tensor_parallel_problem  # what the recipe refuses at load, said before launch
    from toolkit.parallel.sequence import attention_dropout  # what the ring refuses (disable_dropout), said here too

    muon, transient, largest = _muon_count(net) if optim == "muon" else (0, 0, 0)
    return ModelCount(params=params, trainable=trainable, layers=layers, width=width, heads=heads, vocab=logits,
                      tp_problem=lambda tp: tensor_parallel_problem(config, tp), quantized=quantized,
                      quantized_bytes=quantized_bytes, stage_params=lambda stages: _stage_params(net, stages),
                      muon=muon, muon_transient=transient, muon_largest=largest,
                      attention_dropout=attention_dropout(config) is not None)


def _muon_count(net) -> tuple[int, int, int]:
    """(Muon's parameters, the bytes of its largest matrix's working set, its largest matrix's parameters).
    torch's Muon step holds, for one matrix
    at a time, R x C: the Nesterov update (fp32, R C) and, in the iterations on m = min(R, C), n = max: their input
    and output (m n each), the Gram matrix and its update (m^2 each); counted at 4 bytes (muon_ns_dtype float32;
    bfloat16's iterations take half), whole (under FSDP2, HSDP and TP the owner rank iterates on the whole matrix:
    ``muon_gathered`` counts what it gathers besides)."""
    from toolkit.training.optimizers import muon_split

    matrices = [p.shape for _, p in muon_split(net)[0]]
    working = max((3 * r * c + 2 * min(r, c) ** 2 for r, c in matrices), default=0)
    return sum(r * c for r, c in matrices), 4 * working, max((r * c for r, c in matrices), default=0)


def muon_gathered(m: ModelCount, strategy: str, devices: int, per_node: int) -> float:
    """Bytes an owner rank holds gathered during Muon's step under a sharded layout (``toolkit.training.newton_schulz``):
    the whole fp32 updates of the matrices it owns (owners balance the iterations' cost: about Muon's group / the
    shard degree, give or take one largest matrix) and, while it gathers one, the pieces and their concatenation
    (twice the largest matrix). 0 where every rank holds whole matrices (DDP: the working set alone)."""
    shards = {"FSDP2": devices, "HSDP": per_node, "TP": per_node}.get(strategy, 1)
    if not m.muon or shards == 1:
        return 0.0
    return 4.0 * (m.muon / shards + 3 * m.muon_largest)


def _stage_params(net, stages: int) -> list[int] | None:
    from toolkit.parallel.pipeline import stage_parameters

    try:
        return stage_parameters(net, stages)
    except ConfigError:  # not a family the pipeline cuts, or fewer layers than stages
        return None


def pipeline_plan(m: ModelCount, stages: int, micro_batches: int, micro: int, seq: int, precision: str,
                  checkpointing: bool) -> list[dict] | None:
    """Per stage of a pipeline (``toolkit.parallel.pipeline``, torch AdamW: 16 bytes a parameter, whole on each replica): the
    model states, and the activations each schedule keeps in flight (GPipe: all m micro-batches until their
    backward; 1F1B: stage i at most P - i); the logits on the last stage only. None when the model has no cut."""
    held = m.stage_params(stages)
    if held is None:
        return None
    per_layer = activation_bytes(ModelCount(0, 0, 1, m.width, m.heads, 0), micro, seq, precision, checkpointing)
    logits = activation_bytes(ModelCount(0, 0, 0, m.width, m.heads, m.vocab), micro, seq, precision, False)
    layers = [max(1, round(m.layers * h / sum(held))) for h in held]  # layers of the stage, by its share
    rows = []
    for i, params in enumerate(held):
        act = {case: per_layer[case] * layers[i] + (logits[case] if i == stages - 1 else 0) for case in per_layer}
        states = 16 * params
        rows.append({"stage": i, "params": params, "states": states,
                     "gpipe": {k: states + v * micro_batches for k, v in act.items()},
                     "1f1b": {k: states + v * min(micro_batches, stages - i) for k, v in act.items()}})
    return rows


def format_pipeline(rows: list[dict] | None, stages: int, micro_batches: int, args) -> list[str]:
    """The per-stage table, the bubble and the launch command of a pipeline of ``stages``."""
    if rows is None:
        return ["", f"pipeline parallel {stages}: no cut for this model (Llama-family and GPT-2 causal LMs with at "
                    f"least {stages} layers)"]
    bubble = (stages - 1) / (micro_batches + stages - 1)
    lines = ["", f"pipeline parallel {stages} stages x {args.gpus * args.nodes // stages} replicas, {micro_batches} "
                 f"micro-batches (gradient_accumulation_steps): bubble (P - 1) / (m + P - 1) = {bubble:.1%} of a step",
             f"{'stage':<6} {'params':>9} {'states':>8} {'GPipe total (exp.)':>19} {'1F1B total (exp.)':>18}"]
    for r in rows:
        lines.append(f"{r['stage']:<6} {r['params'] / 1e6:>8.1f}M {r['states'] / GB:>8.2f} "
                     f"{r['gpipe']['expected'] / GB:>19.2f} {r['1f1b']['expected'] / GB:>18.2f}")
    lines.append(f"  accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes "
                 f"{args.gpus * args.nodes} recipes/{args.recipe}.py --config recipes/configs/"
                 f"{RECIPE_CONFIGS[args.recipe]} {recipe_fields(args)} --pipeline_parallel_size {stages} "
                 f"--pipeline_schedule 1f1b --gradient_accumulation_steps {micro_batches}")
    return lines


def _lora_trainable(net, lora_r: int, lora_target_modules: list[str] | None) -> int:
    """The parameters peft trains on ``net`` (meta device: nothing is allocated) with the recipes' LoRA config
    (toolkit.models.lora.lora_config, their task type: a classifier's head is trained in full, as the recipe does)."""
    import torch

    from toolkit.config import ModelArguments
    from toolkit.models.lora import lora_config, wrap

    args = ModelArguments(lora_r=lora_r, lora_target_modules=lora_target_modules)
    name = type(net).__name__
    task = "SEQ_CLS" if name.endswith("ForSequenceClassification") else (
        "CAUSAL_LM" if name.endswith(("ForCausalLM", "LMHeadModel")) else None)
    try:
        with torch.device("meta"):
            wrapped = wrap(net, lora_config(args, task))
    except ValueError as e:  # a target module the model does not have, or no default for its type
        raise ConfigError("lora_target_modules", f"peft cannot place LoRA on this model: {e}") from None
    return sum(p.numel() for p in wrapped.parameters() if p.requires_grad)


def _build(config):
    """The model the recipes would load: the config's own architecture (``BertForSequenceClassification`` for a
    classifier, ``LlamaForCausalLM`` ...) when transformers has it, else a causal LM, else the bare model (a sentence
    encoder such as all-MiniLM-L6-v2 names ``BertModel``: what ``recipes/classify.py`` trains is that plus a
    num_labels x width head, which the count misses by that much)."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls(config)
    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM.from_config(config)
    return AutoModel.from_config(config)


def state_bytes(m: ModelCount, precision: str, deepspeed_stage: int | None) -> dict:
    """Unsharded bytes of weights, gradients and optimizer state (AdamW) for the whole model."""
    if deepspeed_stage is not None:
        if precision in ("bf16", "fp16"):
            weight, grad, optim = 2, 2, 12
        else:
            weight, grad, optim = 4, 4, 8 if deepspeed_stage == 3 else 12
    else:
        weight, grad, optim = 4, 4, 8
    # optim muon (torch strategies only): one fp32 momentum buffer (4 bytes) a Muon parameter instead of AdamW's 8
    return {"weights": m.weight_bytes(weight), "gradients": grad * m.trainable,
            "optimizer": optim * m.trainable - 4 * m.muon}


def model_states_per_device(m: ModelCount, strategy: str, devices: int, per_node: int, precision: str) -> dict:
    """Bytes of model states one device holds under ``strategy`` (see the module docstring); "cpu" for offload."""
    s = state_bytes(m, precision, int(strategy[5]) if strategy.startswith("ZeRO") else None)
    w, g, o = s["weights"], s["gradients"], s["optimizer"]
    if strategy == "DDP":
        return {"weights": w, "gradients": g, "optimizer": o}
    if strategy == "ZeRO-1":
        return {"weights": w, "gradients": g, "optimizer": o / devices}
    if strategy == "ZeRO-2":
        return {"weights": w, "gradients": g / devices, "optimizer": o / devices}
    if strategy in ("ZeRO-3", "FSDP2"):
        return {"weights": w / devices, "gradients": g / devices, "optimizer": o / devices}
    if strategy == "ZeRO-3 + offload":
        return {"weights": w / devices, "gradients": g / devices, "optimizer": 0.0, "cpu": o / devices}
    if strategy == "HSDP":
        return {"weights": w / per_node, "gradients": g / per_node, "optimizer": o / per_node}
    if strategy == "TP":  # split over the devices of one node (the planned layers: nearly every parameter)
        return {"weights": w / per_node, "gradients": g / per_node, "optimizer": o / per_node}
    raise ValueError(strategy)


def sequence_plan(m: ModelCount, rows: list[dict], sp: int, args, ring: bool = False) -> list[str]:
    """Ulysses (or, ``ring``, ring attention: ``context_parallel_size``) over ``sp`` ranks on DDP and FSDP2, the two
    launch configs it runs on: per device the same model states, activations / n (the ring: attention's blocks / n^2),
    and the launch command; data-parallel size devices / n. Ulysses needs the heads divisible by n, the ring does not."""
    devices = args.gpus * args.nodes
    name, field = ("context", "context_parallel_size") if ring else ("sequence", "sequence_parallel_size")
    if devices % sp or (m.heads % sp and not ring):
        return ["", f"{name} parallel {sp}: needs {sp} to divide the {devices} devices"
                    + ("" if ring else f" and the model's {m.heads} attention heads")]
    lines = ["", f"{name} parallel {sp} ({'ring attention' if ring else 'Ulysses'}, {field}): each device 1/{sp} of "
                 f"every sequence; {devices // sp} data-parallel groups",
             f"{'strategy':<9} {'states':>8} {'activations':>17} {'total (expected)':>17} {'fits':>5}  launch"]
    for r in rows:
        if r["strategy"] not in ("DDP", "FSDP2") or not r["config"]:
            continue
        act = activation_bytes(m, args.micro_batch, args.seq_len, args.precision, args.gradient_checkpointing, sp=sp,
                               ring=ring)
        total = {case: r["model_states"] + a for case, a in act.items()}
        lines.append(f"{r['strategy']:<9} {r['model_states'] / GB:>8.2f} "
                     f"{'/'.join(f'{act[k] / GB:.1f}' for k in ('low', 'expected', 'high')):>17} "
                     f"{total['expected'] / GB:>17.2f} {_fits(total, args.gpu_memory):>5}  accelerate launch "
                     f"{r['config']} recipes/{args.recipe}.py --config recipes/configs/{RECIPE_CONFIGS[args.recipe]} "
                     f"{recipe_fields(args)} --{field} {sp}"
                     + (" --disable_dropout true" if ring and m.attention_dropout else ""))
    return lines


def activation_bytes(m: ModelCount, micro: int, seq: int, precision: str, checkpointing: bool,
                     tp: int = 1, sp: int = 1, ring: bool = False) -> dict:
    """Activation bytes of one micro batch on one device: low / expected / high. With tensor parallelism over ``tp``
    ranks, what lives inside attention and the MLP splits t ways, the layer's inputs and norms do not (the same
    paper: 10 s b h + 24 s b h / t + 5 a s^2 b / t). With Ulysses sequence parallelism over ``sp`` ranks
    (``toolkit.parallel.sequence``) each rank holds s / n positions of everything but attention, and attention's
    s x s matrices for a / n heads: all of it / n. Under ring attention (``ring``, ``toolkit.parallel.ring``) a rank
    holds s / n positions of everything, and of attention one step's block at a time, its s / n queries against
    s / n keys (the flash kernels keep no more): the quadratic term / n^2."""
    b, h, a, L, V = micro, m.width, m.heads, m.layers, m.vocab
    s = seq / sp
    scale = 1 if precision in ("bf16", "fp16") else 2  # the formula counts 16-bit activations
    linear = 10 * s * b * h + 24 * s * b * h / tp
    quadratic = 5 * a * seq * seq * b / (tp * sp * (sp if ring else 1))
    per_layer = {"low": linear, "expected": linear + quadratic / 2, "high": linear + quadratic}
    logits = b * s * V * 8
    out = {}
    for (case, layer), logit_share in zip(per_layer.items(), (0.5, 1.0, 1.5)):
        layers = (L * 2 * s * b * h + layer) if checkpointing else L * layer
        out[case] = scale * layers + logit_share * logits
    return out


def reference_per_device(m: ModelCount, strategy: str, devices: int, per_node: int, precision: str) -> float:
    """Bytes of DPO's live reference copy on one device (``toolkit.tasks.reference``): weights only, no gradients or
    optimizer state, sharded as the policy's weights are (ZeRO-3 and FSDP2: / D, HSDP: / devices per node), whole
    under DDP and ZeRO-1/2 (a stage-0 engine: 2-byte weights under DeepSpeed's bf16/fp16, as TRL prepares it)."""
    return model_states_per_device(ModelCount(m.params, 0, m.layers, m.width, m.heads, m.vocab,
                                              quantized=m.quantized, quantized_bytes=m.quantized_bytes),
                                   strategy, devices, per_node, precision)["weights"]


STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 + offload", "FSDP2", "HSDP", "TP")
QUANTIZED_STRATEGIES = ("DDP", "ZeRO-2", "FSDP2")  # toolkit.models.quantization.PROVEN's, as the plan names them


# accelerate's --mixed_precision for the plan's --precision: the configs ship with 'no', and the plan's bytes assume
# the precision asked for (DeepSpeed's 2-byte weights under bf16/fp16).
MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def launch_config(strategy: str, gpus: int, nodes: int, precision: str = "bf16") -> str | None:
    """The ``accelerate launch`` options that run ``strategy`` as planned (None: not with these versions on this
    layout): every value the plan assumes is on the command line, since the configs' defaults (2 processes, no
    mixed precision) are not the plan's."""
    c = "--config_file accelerate_configs/"
    if strategy == "TP" and nodes > 1:  # within one node and alone: TP with data parallelism is refused
        return None
    if strategy == "ZeRO-1":
        c += "zero2.yaml --zero_stage 1"
    elif strategy == "HSDP":  # shard within a node (fast links), replicate across nodes
        c += f"hsdp.yaml --parallelism_config_dp_replicate_size {nodes} --parallelism_config_dp_shard_size {gpus}"
    elif strategy == "TP":
        c += f"tp.yaml --parallelism_config_tp_size {gpus}"
    else:
        c += {"DDP": "ddp.yaml", "ZeRO-2": "zero2.yaml", "ZeRO-3": "zero3.yaml",
              "ZeRO-3 + offload": "zero3_offload.yaml", "FSDP2": "fsdp.yaml"}[strategy]
    machines = f" --num_machines {nodes}" if nodes > 1 else ""
    return f"{c} --num_processes {gpus * nodes}{machines} --mixed_precision {MIXED_PRECISION[precision]}"


def _fits(total: dict, gpu_memory: float) -> str:
    if total["high"] <= HEADROOM * gpu_memory:
        return "yes"
    return "maybe" if total["expected"] <= HEADROOM * gpu_memory else "no"


def plan(m: ModelCount, gpus: int, gpu_memory: float, nodes: int = 1, micro: int = 4, seq: int = 2048,
         precision: str = "bf16", checkpointing: bool = False, reference: bool = False) -> list[dict]:
    """One row per strategy. ``activations``/``total``/``fits`` are for the run asked for (``checkpointing``); the
    same for the other choice are under ``*_other`` so that a user sees what checkpointing would change.
    ``reference``: DPO's live reference copy is counted too (``reference_per_device``)."""
    devices = gpus * nodes
    rows = []
    for name in STRATEGIES:
        config = launch_config(name, gpus, nodes, precision)
        states = model_states_per_device(m, name, devices, gpus, precision)
        why_not = None
        if name == "TP" and config:
            why_not = m.tp_problem(gpus)
        if m.quantized and name not in QUANTIZED_STRATEGIES:
            why_not = f"a 4-bit base is refused under {name} (checked: {', '.join(QUANTIZED_STRATEGIES)})"
        if m.muon and name.startswith("ZeRO"):  # toolkit.parallel.accelerator.MUON_LAUNCHES
            why_not = "optim muon is refused under DeepSpeed ZeRO (flat 1-D partitions)"
        # the working set of one matrix at a time, on every device; the matrices an owner rank gathers
        states["optimizer"] += m.muon_transient + muon_gathered(m, name, devices, gpus)
        if reference:
            states["reference"] = reference_per_device(m, name, devices, gpus, precision)
            if name == "TP" and config and not why_not:  # a live reference is refused under TP
                why_not = "DPO's live reference is not sharded under TP: add --precompute-ref-log-probs"
        config = None if why_not else config
        on_device = sum(v for k, v in states.items() if k != "cpu")
        tp = gpus if name == "TP" else 1
        row = {"strategy": name, "config": config, **states, "model_states": on_device, "why_not": why_not}
        for suffix, ckpt in (("", checkpointing), ("_other", not checkpointing)):
            act = activation_bytes(m, micro, seq, precision, ckpt, tp=tp)
            total = {case: on_device + a for case, a in act.items()}
            row.update({f"activations{suffix}": act, f"total{suffix}": total,
                        f"fits{suffix}": _fits(total, gpu_memory) if config else "n/a"})
        rows.append(row)
    return rows


def parse_size(text: str) -> float:
    match = re.fullmatch(r"\s*([\d.]+)\s*(GB|GiB|TB|MB)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 80GB)")
    unit = (match.group(2) or "GB").lower()
    return float(match.group(1)) * {"gb": 1e9, "gib": 2**30, "tb": 1e12, "mb": 1e6}[unit]


def quantized_line(m: ModelCount) -> list[str]:
    """With --load-in-4bit: the base's quantized bytes per weight, constants included."""
    if not m.quantized:
        return []
    return [f"4-bit base: {m.quantized / 1e9:.3f} B weights quantized at {m.quantized_bytes / m.quantized:.4f} bytes "
            f"each (packed 0.5 + quantization constants); the other {(m.params - m.quantized) / 1e9:.3f} B (embeddings, "
            "norms, head, adapters) in full precision"]


def muon_line(m: ModelCount) -> list[str]:
    if not m.muon:
        return []
    return [f"optim muon: {m.muon / 1e9:.3f} B parameters in Muon's group (4 bytes of state each), "
            f"{(m.trainable - m.muon) / 1e9:.3f} B in AdamW's (8); optim adds {m.muon_transient / GB:.2f} GB on every "
            "device for the largest matrix's Newton-Schulz working set (fp32, whole), and under FSDP2, HSDP and TP "
            "the whole matrices a device iterates on as their owner (in the optimizer column)"]


# async_save stages what each rank holds of the weights and the optimizer state (DCP's get_state_dict: whole under
# DDP, this rank's shards under FSDP2) in host memory; the launches it runs under (toolkit.parallel.accelerator)
ASYNC_SAVE_STRATEGIES = ("DDP", "FSDP2")
MIB = 2**20


def async_save_line(rows: list[dict]) -> list[str]:
    """With --async-save: the host memory each rank's staged copy takes (toolkit.checkpointing.checkpoint.AsyncSaves,
    which logs the same figure, measured, at the first save)."""
    staged = [f"{r['strategy']} {(r['weights'] + r['optimizer']) / GB:.2f} GB ({(r['weights'] + r['optimizer']) / MIB:.1f}"
              " MiB)" for r in rows if r["strategy"] in ASYNC_SAVE_STRATEGIES]  # MiB: the log's unit
    return [f"async_save: each checkpoint is staged in host memory, per rank: {', '.join(staged)} (the weights and "
            "optimizer state the rank holds); refused under the other strategies"]


def format_plan(m: ModelCount, rows: list[dict], args) -> str:
    ckpt, other = ("with", "without") if args.gradient_checkpointing else ("without", "with")
    lines = [
        f"{args.model}: {m.params / 1e9:.2f} B parameters ({m.trainable / 1e9:.4f} B trained), {m.layers} layers x "
        f"{m.width}; {args.nodes} node(s) x {args.gpus} device(s) of {args.gpu_memory / GB:.0f} GB; "
        f"micro batch {args.micro_batch} x {args.seq_len} tokens, {args.precision}, {ckpt} gradient checkpointing",
        f"GB (10^9 bytes) per device. activations low / expected / high, {ckpt} and {other} gradient checkpointing; "
        "fits: high (maybe: expected) below 90% of the device",
        *quantized_line(m),
        *muon_line(m),
        "",
        f"{'strategy':<17} {'weights':>8} {'grads':>8} {'optim':>8} {'ref':>8} {'states':>8} {'activations':>17} "
        f"{other + ' ckpt':>17} {'total (expected)':>17} {'fits':>5} {other + ' ckpt':>12}  launch",
    ]
    for r in rows:
        acts = ["/".join(f"{a[k] / GB:.1f}" for k in ("low", "expected", "high"))
                for a in (r["activations"], r["activations_other"])]
        cpu = f" (+{r['cpu'] / GB:.1f} GB optimizer state in CPU memory)" if r.get("cpu") else ""
        launch = (f"accelerate launch {r['config']}{cpu}" if r["config"] else r["why_not"] or
                  "one node only (tensor parallel with data parallelism is refused with these versions)")
        lines.append(f"{r['strategy']:<17} {r['weights'] / GB:>8.2f} {r['gradients'] / GB:>8.2f} "
                     f"{r['optimizer'] / GB:>8.2f} {r.get('reference', 0) / GB:>8.2f} {r['model_states'] / GB:>8.2f} "
                     f"{acts[0]:>17} {acts[1]:>17} "
                     f"{r['total']['expected'] / GB:>17.2f} {r['fits']:>5} {r['fits_other']:>12}  {launch}")
    lines += [*(async_save_line(rows) if getattr(args, "async_save", False) else []), "", *recommendation(rows, args)]
    if args.nodes > 1:
        lines.append(f"on each of the {args.nodes} nodes, also: --machine_rank <0..{args.nodes - 1}> "
                     "--main_process_ip <node 0's address> --main_process_port 29500 (docs/multinode.md)")
    return "\n".join(lines)


# The layout recommended, first that fits: the least communication first (DDP all-reduces gradients only; each ZeRO
# stage adds collectives), HSDP before ZeRO-3 across nodes (its all-gathers stay within a node; on one node it is
# FSDP2), TP before offload, and offload last (optimizer state over the host link every step).
PREFERENCE = ("DDP", "ZeRO-1", "ZeRO-2", "HSDP", "ZeRO-3", "FSDP2", "TP", "ZeRO-3 + offload")
# The config each recipe ships with, which the recommended command starts from (its fields, then the plan's).
RECIPE_CONFIGS = {"gpt2": "gpt2.yaml", "sft": "sft_smollm2.yaml", "classify": "classify_minilm.yaml",
                  "dpo": "dpo_smollm2.yaml"}


def recommended(rows: list[dict], nodes: int) -> dict | None:
    """The row ``PREFERENCE`` picks among those that fit ("yes", else "maybe"); None when none does."""
    by_name = {r["strategy"]: r for r in rows if r["config"] and (r["strategy"] != "HSDP" or nodes > 1)}
    for verdict in ("yes", "maybe"):
        for name in PREFERENCE:
            if name in by_name and by_name[name]["fits"] == verdict:
                return by_name[name]
    return None


def recommendation(rows: list[dict], args) -> list[str]:
    """The whole command for the recommended layout: the launch options, the recipe, its shipped config and the
    fields the plan assumed (a line to start from: put your own config after --config)."""
    row = recommended(rows, args.nodes)
    if row is None:
        return ["nothing fits as asked: try --gradient-checkpointing, a smaller --micro-batch or --seq-len, LoRA "
                "(--lora-r), more devices or devices with more memory"]
    fits = "fits" if row["fits"] == "yes" else "may fit (the expected activations do, the high ones do not)"
    return [f"recommended: {row['strategy']} ({fits}; of the layouts that fit, the one with the least communication):",
            f"  accelerate launch {row['config']} recipes/{args.recipe}.py --config recipes/configs/"
            f"{RECIPE_CONFIGS[args.recipe]} {recipe_fields(args)}"]


def recipe_fields(args) -> str:
    """The recipe's fields that the plan's figures assume (micro batch, sequence length, checkpointing, LoRA)."""
    fields = (f"--model_name_or_path {args.model if not args.model.endswith('.json') else os.path.dirname(args.model)} "
              f"--per_device_train_batch_size {args.micro_batch} --block_size {args.seq_len}")
    if args.gradient_checkpointing:
        fields += " --gradient_checkpointing true"
    if args.precompute_ref_log_probs:
        fields += " --precompute_ref_log_probs true"
    if args.optim == "muon":
        fields += " --optim muon"
    if args.lora_r:
        fields += f" --use_peft true --lora_r {args.lora_r}"
        if args.load_in_4bit:
            fields += " --load_in_4bit true" + (" --use_bnb_nested_quant true" if args.use_bnb_nested_quant else "")
        if args.lora_target_modules:
            fields += " --lora_target_modules " + " ".join(args.lora_target_modules)
    return fields


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit plan", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Hub name, a model folder or a config.json")
    parser.add_argument("--gpus", type=int, required=True, help="devices per node")
    parser.add_argument("--gpu-memory", type=parse_size, required=True, help="memory of one device, e.g. 80GB")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--lora-r", type=int, default=None, help="count LoRA adapters of this rank (use_peft)")
    parser.add_argument("--lora-target-modules", nargs="+", default=None,
                        help="the recipe's lora_target_modules (default: peft's for the model type, as the recipes)")
    parser.add_argument("--load-in-4bit", action="store_true",
                        help="the base in 4 bits (QLoRA, load_in_4bit: needs --lora-r), NF4 or FP4 alike")
    parser.add_argument("--use-bnb-nested-quant", action="store_true",
                        help="with --load-in-4bit: double quantization (use_bnb_nested_quant)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--optim", choices=["adamw_torch", "muon"], default="adamw_torch",
                        help="muon: Muon's group holds one fp32 momentum buffer a parameter (4 bytes, not AdamW's 8), "
                             "plus its largest matrix's Newton-Schulz working set")
    parser.add_argument("--recipe", choices=["gpt2", "sft", "classify", "dpo"], default="gpt2",
                        help="dpo: count the live reference model too (not with --lora-r: the adapter is disabled for "
                             "it; not with --precompute-ref-log-probs)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                        help="also plan a pipeline of this many stages (per stage: states, activations in flight)")
    parser.add_argument("--accumulation", type=int, default=8,
                        help="the pipeline's micro-batches (gradient_accumulation_steps)")
    parser.add_argument("--sequence-parallel-size", type=int, default=1,
                        help="also plan Ulysses sequence parallelism over this many devices (activations / n)")
    parser.add_argument("--context-parallel-size", type=int, default=1,
                        help="also plan ring attention over this many devices (activations / n, attention / n^2)")
    parser.add_argument("--precompute-ref-log-probs", action="store_true",
                        help="DPO's precompute_ref_log_probs: no reference in memory while training")
    parser.add_argument("--async-save", action="store_true",
                        help="async_save: also the host memory of each rank's staged checkpoint (DDP, FSDP2)")
    args = parser.parse_args(argv)
    for name in ("gpus", "nodes", "micro_batch", "seq_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        if args.load_in_4bit and not args.lora_r:
            raise ConfigError("load_in_4bit", "a quantized base cannot be trained, only adapters on it: add --lora-r")
        if args.load_in_4bit and args.pipeline_parallel_size > 1:  # what the recipes refuse (toolkit.models.quantization)
            raise ConfigError("load_in_4bit", "a 4bit base is not supported under pipeline parallelism: drop "
                                              "--pipeline-parallel-size, or --load-in-4bit")
        if args.context_parallel_size > 1 and args.sequence_parallel_size > 1:  # as the recipes refuse it
            raise ConfigError("context_parallel_size", "ring attention with Ulysses (sequence_parallel_size) is not "
                                                       "proven together: plan one of them")
        if args.optim == "muon" and (args.lora_r or args.pipeline_parallel_size > 1):  # as the recipes refuse it
            raise ConfigError("optim", "muon is refused with LoRA and with a pipeline: use --optim adamw_torch")
        m = count_model(args.model, args.lora_r, args.lora_target_modules, quantize_bits=4 if args.load_in_4bit else None,
                        nested=args.use_bnb_nested_quant, optim=args.optim)
    except ConfigError as e:  # the LoRA fields (the recipe's own checks, field names as the recipe spells them)
        print(f"plan error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # no such folder, no config.json, a Hub name while offline
        print(f"plan error: --model {args.model}: {str(e).splitlines()[0]} (give a model folder, its config.json "
              "or a Hub name that is reachable or cached)", file=sys.stderr)
        return 2
    reference = args.recipe == "dpo" and not args.lora_r and not args.precompute_ref_log_probs
    rows = plan(m, args.gpus, args.gpu_memory, args.nodes, args.micro_batch, args.seq_len, args.precision,
                args.gradient_checkpointing, reference=reference)
    print(format_plan(m, rows, args))
    stages = args.pipeline_parallel_size
    if stages > 1:
        if (args.gpus * args.nodes) % stages:
            parser.error(f"--pipeline-parallel-size {stages} must divide the {args.gpus * args.nodes} devices")
        staged = pipeline_plan(m, stages, args.accumulation, args.micro_batch, args.seq_len, args.precision,
                               args.gradient_checkpointing)
        print("\n".join(format_pipeline(staged, stages, args.accumulation, args)))
    if args.sequence_parallel_size > 1:
        print("\n".join(sequence_plan(m, rows, args.sequence_parallel_size, args)))
    if args.context_parallel_size > 1:
        print("\n".join(sequence_plan(m, rows, args.context_parallel_size, args, ring=True)))
    return 0
