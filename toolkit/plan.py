"""``python -m toolkit plan``: which strategy fits, per device, before a GPU is paid for.

    python -m toolkit plan --model meta-llama/Llama-2-7b-hf --gpus 8 --gpu-memory 80GB [--nodes 2]
        [--micro-batch 4 --seq-len 2048] [--precision bf16] [--lora-r 16] [--gradient-checkpointing]

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
    HSDP       everything / (devices per node): sharded within a node, replicated across nodes
    TP         everything / (devices per node), one node (tp.yaml: TP with data parallelism is refused); activations
               inside attention and the MLP / t too

With LoRA (``--lora-r``) the base weights are frozen (weights only, sharded like the weights); the adapters (r x
(in + out) per linear layer of every block) carry the 16 bytes.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4,
16-bit activations; x2 in fp32), per layer, for micro batch b, sequence s, width h, a heads:

    low       34 s b h                  attention without its s x s matrices (flash / SDPA kernels)
    expected  34 s b h + 5 a s^2 b / 2  half of the eager attention matrices (SDPA on some shapes, masks)
    high      34 s b h + 5 a s^2 b      eager attention storing scores, softmax and dropout mask

plus the logits of the whole micro batch, b s V x (4 fp32 + 4 fp32 gradient) bytes (x 0.5 / 1 / 1.5), which
``loss_chunk_size`` removes. With ``--gradient-checkpointing`` each layer keeps only its input (2 s b h) and one
layer's activations are alive again during its recompute. A strategy fits when model states + high activations are
below 90% of the device's memory (CUDA context and fragmentation take the rest); "maybe" when only the expected do.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

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


def count_model(model: str, lora_r: int | None = None) -> ModelCount:
    """Parameters of ``model`` (a Hub name, a folder or a config.json), built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.accounting import model_shape

    source = os.path.dirname(model) if model.endswith(".json") else model
    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in net.parameters())  # parameters() yields a tied parameter once
    trainable = params
    if lora_r:
        # LoRA on every linear layer of the blocks (peft's "all-linear"): r x (in + out) per layer
        trainable = sum(lora_r * (m.in_features + m.out_features) for name, m in net.named_modules()
                        if isinstance(m, torch.nn.Linear) and name != "lm_head" and "lm_head" not in name)
        trainable += sum(lora_r * (m.weight.shape[0] + m.weight.shape[1]) for name, m in net.named_modules()
                         if type(m).__name__ == "Conv1D")  # GPT-2's linear layers
        params += trainable  # the adapters are weights too (held like the base's), and the only ones with state
    layers, width = model_shape(config)
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    return ModelCount(params=params, trainable=trainable, layers=layers, width=width, heads=heads,
                      vocab=config.vocab_size)


def state_bytes(m: ModelCount, precision: str, deepspeed_stage: int | None) -> dict:
    """Unsharded bytes of weights, gradients and optimizer state (AdamW) for the whole model."""
    if deepspeed_stage is not None:
        if precision in ("bf16", "fp16"):
            weight, grad, optim = 2, 2, 12
        else:
            weight, grad, optim = 4, 4, 8 if deepspeed_stage == 3 else 12
    else:
        weight, grad, optim = 4, 4, 8
    return {"weights": weight * m.params, "gradients": grad * m.trainable, "optimizer": optim * m.trainable}


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


def activation_bytes(m: ModelCount, micro: int, seq: int, precision: str, checkpointing: bool,
                     tp: int = 1) -> dict:
    """Activation bytes of one micro batch on one device: low / expected / high. With tensor parallelism over ``tp``
    ranks, what lives inside attention and the MLP splits t ways, the layer's inputs and norms do not (the same
    paper: 10 s b h + 24 s b h / t + 5 a s^2 b / t)."""
    b, s, h, a, L, V = micro, seq, m.width, m.heads, m.layers, m.vocab
    scale = 1 if precision in ("bf16", "fp16") else 2  # the formula counts 16-bit activations
    linear = 10 * s * b * h + 24 * s * b * h / tp
    quadratic = 5 * a * s * s * b / tp
    per_layer = {"low": linear, "expected": linear + quadratic / 2, "high": linear + quadratic}
    logits = b * s * V * 8
    out = {}
    for (case, layer), logit_share in zip(per_layer.items(), (0.5, 1.0, 1.5)):
        layers = (L * 2 * s * b * h + layer) if checkpointing else L * layer
        out[case] = scale * layers + logit_share * logits
    return out


STRATEGIES = (  # name, accelerate_configs/ file
    ("DDP", "ddp.yaml"),
    ("ZeRO-1", "zero2.yaml with zero_stage: 1"),
    ("ZeRO-2", "zero2.yaml"),
    ("ZeRO-3", "zero3.yaml"),
    ("ZeRO-3 + offload", "zero3_offload.yaml"),
    ("FSDP2", "fsdp.yaml"),
    ("HSDP", "hsdp.yaml"),
    ("TP", "tp.yaml"),
)


def plan(m: ModelCount, gpus: int, gpu_memory: float, nodes: int = 1, micro: int = 4, seq: int = 2048,
         precision: str = "bf16", checkpointing: bool = False) -> list[dict]:
    devices = gpus * nodes
    act = activation_bytes(m, micro, seq, precision, checkpointing)
    rows = []
    for name, config in STRATEGIES:
        if (name == "HSDP" and nodes == 1) or (name == "TP" and nodes > 1):  # TP: within a node, without dp (tp.yaml)
            continue
        states = model_states_per_device(m, name, devices, gpus, precision)
        row_act = activation_bytes(m, micro, seq, precision, checkpointing, tp=gpus) if name == "TP" else act
        on_device = sum(v for k, v in states.items() if k != "cpu")
        total = {case: on_device + a for case, a in row_act.items()}
        fits = "yes" if total["high"] <= HEADROOM * gpu_memory else (
            "maybe" if total["expected"] <= HEADROOM * gpu_memory else "no")
        rows.append({"strategy": name, "config": config, **states, "model_states": on_device,
                     "activations": row_act, "total": total, "fits": fits})
    return rows


def parse_size(text: str) -> float:
    match = re.fullmatch(r"\s*([\d.]+)\s*(GB|GiB|TB|MB)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 80GB)")
    unit = (match.group(2) or "GB").lower()
    return float(match.group(1)) * {"gb": 1e9, "gib": 2**30, "tb": 1e12, "mb": 1e6}[unit]


def format_plan(m: ModelCount, rows: list[dict], args) -> str:
    lines = [
        f"{args.model}: {m.params / 1e9:.2f} B parameters ({m.trainable / 1e9:.4f} B trained), {m.layers} layers x "
        f"{m.width}, vocab {m.vocab}; {args.nodes} node(s) x {args.gpus} device(s) of {args.gpu_memory / GB:.0f} GB; "
        f"micro batch {args.micro_batch} x {args.seq_len} tokens, {args.precision}"
        + (", gradient checkpointing" if args.gradient_checkpointing else ""),
        "GB per device. activations low / expected / high; fits: high (expected) below 90% of the device",
        "",
        f"{'strategy':<17} {'weights':>8} {'grads':>8} {'optim':>8} {'states':>8} {'activations':>20} "
        f"{'total (expected)':>17} {'fits':>5}  launch config",
    ]
    for r in rows:
        a = r["activations"]
        acts = f"{a['low'] / GB:.1f}/{a['expected'] / GB:.1f}/{a['high'] / GB:.1f}"
        cpu = f" (+{r['cpu'] / GB:.1f} CPU)" if r.get("cpu") else ""
        lines.append(f"{r['strategy']:<17} {r['weights'] / GB:>8.2f} {r['gradients'] / GB:>8.2f} "
                     f"{r['optimizer'] / GB:>8.2f} {r['model_states'] / GB:>8.2f} {acts:>20} "
                     f"{r['total']['expected'] / GB:>17.2f} {r['fits']:>5}  {r['config']}{cpu}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit plan", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a Hub name, a model folder or a config.json")
    parser.add_argument("--gpus", type=int, required=True, help="devices per node")
    parser.add_argument("--gpu-memory", type=parse_size, required=True, help="memory of one device, e.g. 80GB")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--lora-r", type=int, default=None)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    m = count_model(args.model, args.lora_r)
    rows = plan(m, args.gpus, args.gpu_memory, args.nodes, args.micro_batch, args.seq_len, args.precision,
                args.gradient_checkpointing)
    print(format_plan(m, rows, args))
    return 0
