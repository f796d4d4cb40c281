"""The real recipe (recipes/gpt2.py), plus two test probes passed as callbacks:

- counts DDP gradient all-reduces per micro-step with a DDP communication hook (proves no_sync skips them);
- records the trained model's logits on a fixed input, to compare with what final/ loads back;
- measures the bytes of weights and optimizer state each rank holds after the last step (for ``toolkit plan``);
- records each ``on_save`` call (the step, the folder, what ``latest`` named then);
- records what each rank really ran (distributed type, world, the prepared model's type, DeepSpeed's stage, clipping
  and step count) and a fingerprint of the full (gathered) weights that rank ends with, to prove ranks agree;
- after ``train`` returned (``after_train``): whether the run's process group is still referenced by
  ``toolkit.parallel.accelerator.keep_process_groups`` (docs/pitfalls.md#gloo-teardown-deadlock), and whether DeepSpeed was
  imported (docs/pitfalls.md#deepspeed-import).
Writes ``probe/comm_rank{R}.json``, ``probe/kept_rank{R}.json``, ``probe/imports_rank{R}.json`` and
``probe/logits.pt`` into output_dir.
"""

import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "recipes"))
import gpt2  # noqa: E402  the recipe itself, unchanged

from toolkit.checkpointing.checkpoint import torch_optimizer  # noqa: E402

PROBE_IDS = torch.arange(100, 124).view(2, 12)


class Probe:
    def __init__(self):
        self.calls = 0
        self.per_micro_step = []  # (step, micro_step, all-reduce calls during that backward)
        self.output_dir = None
        self.weight_decays = None
        self.group = self.probe_dir = None
        self.saves = []  # per on_save: (the state's step, the folder's name, what latest names then on this rank)

    def on_prepared(self, accelerator, model, optimizer):
        import torch.distributed as dist

        self.optimizer = optimizer
        self.group = dist.group.WORLD if dist.is_initialized() else None  # the process group this run trains in
        # weight decay per optimizer group, as the strategy's optimizer holds them (ZeRO-3 once lost the split)
        self.weight_decays = sorted(g["weight_decay"] for g in optimizer.param_groups)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(state, bucket):
                self.calls += 1
                return allreduce_hook(state, bucket)

            model.register_comm_hook(None, counting_hook)

    def on_micro_step(self, accelerator, state, micro_step):
        self.per_micro_step.append((state.step, micro_step, self.calls))
        self.calls = 0

    def on_save(self, accelerator, state, checkpoint):
        latest = os.path.join(os.path.dirname(checkpoint), "latest")
        self.saves.append((state.step, os.path.basename(checkpoint), open(latest).read() if os.path.exists(latest)
                           else None))

    def on_end(self, accelerator, model, summary):
        out = self.probe_dir = os.path.join(summary["final_model"], "..", "probe")
        os.makedirs(out, exist_ok=True)
        record = {"per_micro_step": self.per_micro_step, "distributed_type": summary["distributed_type"],
                  "num_processes": accelerator.num_processes, "process_index": accelerator.process_index,
                  "model_type": type(model).__name__, "is_fsdp2": bool(getattr(accelerator, "is_fsdp2", False)),
                  # how FSDP2 lays a weight over the mesh: ["S(0)"], or ["R", "S(0)"] (Replicate, Shard(0)) for HSDP
                  "placements": [str(p) for p in getattr(next(model.parameters()), "placements", ())],
                  "weights_sha": weights_fingerprint(accelerator, model), "weight_decays": self.weight_decays,
                  "held_bytes": held_bytes(model, self.optimizer, summary["distributed_type"] == "DEEPSPEED"),
                  "saves": self.saves,
                  # optim muon: the matrices each Newton-Schulz path took in the last step (owner ranks or torch's)
                  "muon_newton_schulz": getattr(torch_optimizer(self.optimizer), "newton_schulz", None),
                  # torch_compile with inductor: its graph cache's hits and misses in this run (probe_runs.py clears
                  # dynamo's counters before an inductor run); what the log's "torch_compile:" line says
                  "inductor_cache": inductor_cache()}
        if summary["distributed_type"] in ("MULTI_CPU", "MULTI_GPU") or record["is_fsdp2"]:  # DDP, TP, FSDP2
            record.update(clip_probe(accelerator, model))
        if summary["distributed_type"] == "DEEPSPEED":
            record.update(zero_stage=model.zero_optimization_stage(), gradient_clipping=model.gradient_clipping(),
                          global_steps=model.global_steps, optimizer_type=type(model.optimizer).__name__,
                          basic_optimizer_type=type(getattr(model, "basic_optimizer", None)).__name__)
        with open(os.path.join(out, f"comm_rank{accelerator.process_index}.json"), "w") as f:
            json.dump(record, f)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=PROBE_IDS.to(accelerator.device)).logits.float().cpu()
        if accelerator.is_main_process:
            torch.save(logits, os.path.join(out, "logits.pt"))

    def after_train(self):
        """Once ``train`` has returned: whether its process group is still held (toolkit.parallel.accelerator._KEPT_GROUPS), so
        that its C++ object cannot be destroyed while the process runs Python (the deadlock it prevents hung the
        quickstart's notebook_launcher cell in 2 of 5 executions; this shows the cause gone, deterministically), and
        whether this process has imported DeepSpeed by now (training, checkpoints and the export included)."""
        from toolkit.parallel.accelerator import _KEPT_GROUPS

        if self.group is None or self.probe_dir is None:
            return
        rank = os.environ.get("RANK", "0")
        for name, record in (("kept", {"kept": any(g is self.group for g in _KEPT_GROUPS)}),
                             ("imports", {"deepspeed": "deepspeed" in sys.modules})):
            with open(os.path.join(self.probe_dir, f"{name}_rank{rank}.json"), "w") as f:
                json.dump(record, f)


def inductor_cache() -> list[int] | None:
    """[hits, misses] of inductor's FX graph cache counted in this process (None: dynamo never imported)."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.utils import counters

    return [int(counters["inductor"]["fxgraph_cache_hit"]), int(counters["inductor"]["fxgraph_cache_miss"])]


def clip_probe(accelerator, model) -> dict:
    """toolkit.parallel.clipping on gradients of ones (their norm: the square root of the full model's weight count, each
    weight counted once whatever its shards or replicas), and the collectives it made: one per device mesh and
    layout, not one per parameter (collective)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from toolkit.parallel.clipping import clip_grad_norm

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.ones_like(p)
    with CommDebugMode() as comm:
        norm = clip_grad_norm(accelerator, params, float("inf")).item()
    for p in params:
        p.grad = None
    return {"clip_norm": norm, "clip_weights": sum(p.numel() for p in params), "clip_params": len(params),
            "clip_collectives": comm.get_total_counts()}


def held_bytes(model, optimizer, deepspeed: bool) -> dict:
    """Bytes of the weights and the optimizer state this rank holds (its shards only), each storage counted once
    (ZeRO's parameters are views into flat buffers; under ZeRO-3 in fp32 the master partition *is* the weights')."""
    seen = set()

    def held(t):
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor: this rank's shard
        t = getattr(t, "ds_tensor", t)  # ZeRO-3: this rank's partition
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    # LoRA's adapted layers' own weights (peft's ``base_layer``): with load_in_4bit the packed 4-bit base
    base_layers = sum(held(p) for n, p in model.named_parameters() if ".base_layer." in n)
    seen.clear()
    weights = sum(held(p) for p in model.parameters())
    inner = torch_optimizer(optimizer)  # accelerate's wrapper -> (DeepSpeed's ZeRO optimizer ->) torch's AdamW
    state = sum(held(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    if deepspeed:  # the fp32 master partitions DeepSpeed's AdamW steps on (its params, not the model's)
        state += sum(held(p) for g in inner.param_groups for p in g["params"])
    return {"weights": weights, "optimizer": state, "base_layers": base_layers}


def full_weights(accelerator, model) -> dict:
    """This rank's full weights, gathered from the shards where the strategy shards them (collective)."""
    kind = accelerator.distributed_type.value
    if kind == "DEEPSPEED" and model.zero_optimization_stage() == 3:
        import deepspeed

        params = dict(model.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    if kind == "FSDP":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    # DDP: whole tensors; tensor parallel: DTensor shards, gathered (collective)
    from toolkit.parallel.accelerator import deepspeed_out_of_sight

    with deepspeed_out_of_sight(accelerator):  # as the export: a DDP rank's probe imports no DeepSpeed either
        unwrapped = accelerator.unwrap_model(model)
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in unwrapped.named_parameters()}


def weights_fingerprint(accelerator, model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(full_weights(accelerator, model).items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(callbacks=None):
    probe = Probe()
    summary = gpt2.main(callbacks=[probe, *(callbacks or [])])
    probe.after_train()
    return summary


if __name__ == "__main__":
    from toolkit.cli.recipe import cli

    cli(main)
