"""Building the Accelerator, and the one shim that lets every strategy run for real on CPU ranks (gloo).

On a machine with a GPU (or any torch accelerator) nothing here changes accelerate's behaviour.

On a CPU-only host, accelerate 1.15/1.16 enables DeepSpeed and FSDP only when it finds an accelerator, and otherwise
falls back *silently* (docs/pitfalls.md#cpu-fallback):
  - the DDP config without cpu=True, or an FSDP config: each rank becomes an independent process believing it is
    rank 0 and trains alone on all the data;
  - a DeepSpeed config: num_processes=1 on both ranks, then DeepSpeed's batch-size assertion.
What makes each real on CPU (each tested with 2 gloo ranks against one process: docs/strategies.md#on-cpu):
  - DDP:       ``cpu=True``  (MULTI_CPU over gloo);
  - DeepSpeed: a PartialState created first with ``backend="gloo"`` (cpu stays False, so DeepSpeed is considered);
  - FSDP 1/2:  the same, then the state's distributed_type set to MULTI_GPU so accelerate considers FSDP.
``AcceleratorState`` reuses an existing PartialState, which is what makes the last two work; it is the one fragile
point, so the accelerate range is pinned and ``check_world`` refuses any run whose world is not what was launched.
``TOOLKIT_CPU_SHIM=0`` switches the shim off (to watch accelerate's own fallback being refused).
"""

from __future__ import annotations

import atexit
import math
import os
import sys
from contextlib import contextmanager

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, GradientAccumulationPlugin, ProjectConfiguration

from toolkit import layout
from toolkit.config import TrainingArguments
from toolkit.env import elastic
from toolkit.env.launcher import (
    _env_true,
    has_accelerator,
    launched_parallel_sizes,
    launched_strategy,
    launched_strategy_name,
    launched_world_size,
)
from toolkit.errors import ConfigError
from toolkit.parallel import sequence


def _check_parallel_sizes() -> None:
    """The launch config's parallelism sizes must multiply to the launched world size (a product of 1 is accelerate's
    "plain data parallel over every rank"). Otherwise torch's device mesh fails inside the Accelerator with a raw
    RuntimeError after the process group is up (docs/pitfalls.md#mesh-size): hsdp.yaml (2 x 2) with
    ``--num_processes 2``."""
    sizes, world = launched_parallel_sizes(), launched_world_size()
    product = math.prod(sizes.values()) if sizes else 1
    if product in (1, world):
        return
    shown = " x ".join(f"{name} {size}" for name, size in sizes.items())
    others = product // sizes["dp_replicate"]
    # Only HSDP's replicate degree is suggested: with tp or cp, another dp degree is refused (check_parallelism).
    if world % others == 0 and sizes["tp"] == sizes["cp"] == 1:
        raise ConfigError("parallelism_config_dp_replicate_size",
                          f"the launch config's parallelism sizes ({shown}) need {product} processes, but {world} "
                          f"were launched: pass --parallelism_config_dp_replicate_size {world // others} to accelerate "
                          f"launch, or --num_processes {product}")
    raise ConfigError("num_processes", f"the launch config's parallelism sizes ({shown}) need {product} processes, "
                                       f"but {world} were launched: pass --num_processes {product} to accelerate "
                                       "launch, or --parallelism_config_*_size values whose product is "
                                       f"{world}")


def cpu_shim_enabled() -> bool:
    """``TOOLKIT_CPU_SHIM=0`` turns the shim off, to see what accelerate does on its own (the tests use it to prove
    that ``check_world`` stops the silent fallback)."""
    return os.environ.get("TOOLKIT_CPU_SHIM", "1").lower() not in ("0", "false", "no", "off")


def _prepare_cpu_state(strategy: str) -> dict:
    """Set up accelerate's shared state for a CPU-only host; returns extra Accelerator kwargs."""
    tensor_parallel = launched_parallel_sizes().get("tp", 1) > 1
    if strategy == "ddp" and not tensor_parallel:
        return {"cpu": True}
    if _env_true("ACCELERATE_USE_CPU"):
        raise ConfigError(
            "ACCELERATE_USE_CPU",
            f"is set with a {strategy} launch config; accelerate would quietly run plain DDP instead. Unset it: "
            "toolkit runs DeepSpeed and FSDP on CPU ranks by itself",
        )
    if strategy == "fsdp":
        # FSDP1 refuses sync_module_states on CPU; every rank loads the same weights, so nothing is lost.
        os.environ["FSDP_SYNC_MODULE_STATES"] = "false"
    if strategy == "deepspeed":
        _skip_deepspeed_shm_build()
    state = PartialState(backend="gloo")
    if strategy == "fsdp" or tensor_parallel:
        # accelerate accepts FSDP and ParallelismConfig (TP) only on a multi-device state; cpu=True gives MULTI_CPU,
        # which it refuses ("ParallelismConfig is only compatible with DistributedType.FSDP (version 2) or ...").
        state.distributed_type = DistributedType.MULTI_GPU
    return {}


def _skip_deepspeed_shm_build() -> None:
    # DeepSpeed JIT-compiles a shared-memory comm op on first init (docs/pitfalls.md#deepspeed-shm) only used for
    # inference all-reduce; marking it incompatible skips the build.
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except Exception:
        pass


def _process_group_per_elastic_attempt() -> None:
    """Under torch elastic with restarts, start the process group in a key space of this attempt's own.

    The agent's rendezvous store is shared with the ranks across attempts, and ``init_process_group`` writes keys
    with no attempt in their names, so a restarted rank can read the dead attempt's addresses
    (docs/pitfalls.md#pytorch-135712-elastic-restarts-on-a-shared-store). The same group, initialised by us before
    accelerate (which, like DeepSpeed, keeps a group that already exists), on
    ``PrefixStore("toolkit-attempt-<restart count>")``, reads only keys of its own attempt. The restart count is the
    agent's; on one machine every rank has the same. Across machines it can differ, so there restarts keep needing a
    store per attempt (``toolkit.env.elastic`` refuses them without)."""
    if (not elastic.shares_agent_store() or elastic.max_restarts() <= 0
            or not torch.distributed.is_available() or torch.distributed.is_initialized()):
        return
    from datetime import timedelta

    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                       timeout=timedelta(minutes=10))
    attempt = torch.distributed.PrefixStore(f"toolkit-attempt-{elastic.restart_count()}", store)
    # backend None: gloo for CPU tensors and, where CUDA is, NCCL for GPU ones (what accelerate and DeepSpeed pick).
    torch.distributed.init_process_group(backend=None, store=attempt, rank=int(os.environ["RANK"]),
                                         world_size=int(os.environ["WORLD_SIZE"]))


@contextmanager
def deepspeed_out_of_sight(accelerator: Accelerator):
    """Within: accelerate's ``extract_model_from_parallel`` (behind ``unwrap_model``, ``get_state_dict`` and
    transformers' ``save_pretrained``) does not import DeepSpeed to test the model against its engine class, in a
    run that cannot hold one (not a DeepSpeed launch, DeepSpeed not imported): the import is a large part of a DDP or
    FSDP rank's export (docs/pitfalls.md#deepspeed-import)."""
    import accelerate.utils.other as other

    if accelerator.distributed_type == DistributedType.DEEPSPEED or "deepspeed" in sys.modules:
        yield
        return
    available = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = available


def check_launch(args: TrainingArguments, mixed_precision: str | None = None) -> None:
    """The recipe's fields against the launch this process is in (its environment, as ``accelerate launch`` set it):
    what ``make_accelerator`` refuses before the process group, and ``toolkit train`` before it launches."""
    _check_accumulation_env(args)
    _check_pipeline_precision(args, mixed_precision)  # before the CPU's fp16 line: a GPU host's too
    _check_mixed_precision(mixed_precision)
    _check_skip_nonfinite(args, launched_strategy())
    _check_async_save(args)
    _check_torch_compile(args)
    _check_activation_checkpointing(args)
    _check_parallel_sizes()
    if launched_parallel_sizes():
        _refuse_parallel_sizes(**{name: size for name, size in launched_parallel_sizes().items()})
    _check_pipeline_launch(args, launched_strategy())
    _check_muon_launch(args)
    sequence.check_launch(args)


def make_accelerator(args: TrainingArguments, **kwargs) -> Accelerator:
    """The Accelerator for a run, checked to have the world that was launched."""
    elastic.record_launcher()  # a notebook_launcher rank's first toolkit call (toolkit.training.preemption)
    strategy = launched_strategy()
    _process_group_per_elastic_attempt()
    check_launch(args, kwargs.get("mixed_precision"))
    if strategy == "deepspeed":
        _quiet_deprecated_collectives()
    if not has_accelerator():
        # Wherever DeepSpeed gets imported (a DeepSpeed launch; accelerate's unwrap_model outside our export, which
        # keeps it out of sight), its accelerator detection logs "Setting accelerator to CPU ..." once per rank.
        # Naming the CPU accelerator is what it would pick (docs/pitfalls.md#deepspeed-import).
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    extra = {} if has_accelerator() or not cpu_shim_enabled() else _prepare_cpu_state(strategy)
    trackers = [] if args.report_to in ("none", "", None) else args.report_to
    accelerator = Accelerator(
        # The loop fetches a step's k micro-batches before the first backward (to count the step's tokens), so the
        # loader reaches its end one micro-step early; accelerate's default would then force a sync there. Our steps
        # are always whole groups of k, so the boundary is simply every k-th micro-step.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        # We step the scheduler ourselves once per optimizer step: AcceleratedScheduler otherwise steps it
        # num_processes times per call (docs/pitfalls.md#scheduler-steps), ending a schedule sized in optimizer steps early.
        step_scheduler_with_optimizer=False,
        log_with=trackers or None,
        project_config=ProjectConfiguration(
            project_dir=args.output_dir, logging_dir=layout.path(args.output_dir, layout.TRACKER_LOGS)
        ),
        **extra,
        **kwargs,
    )
    check_world(accelerator, strategy)
    check_parallelism(accelerator)
    accelerator.pipeline_parallel_size = args.pipeline_parallel_size  # read by data_parallel_size
    accelerator.sequence_parallel_size = args.split_size  # and this (Ulysses or the ring)
    atexit.register(_destroy_process_group)
    _honour_zero3_init_flag(accelerator)
    if accelerator.gradient_accumulation_steps != args.gradient_accumulation_steps:
        raise ConfigError(
            "gradient_accumulation_steps",
            f"the recipe says {args.gradient_accumulation_steps} but accelerate uses "
            f"{accelerator.gradient_accumulation_steps}; remove the value from the accelerate config",
        )
    return accelerator


def _check_pipeline_precision(args: TrainingArguments, asked: str | None) -> None:
    # the stages' schedule has no loss scaler (toolkit.parallel.pipeline.build refuses it too, for an Accelerator made elsewhere)
    asked = asked or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if args.pipeline_parallel_size > 1 and asked == "fp16":
        raise ConfigError("mixed_precision", "fp16 loss scaling is not supported under pipeline parallelism: use bf16 "
                                             "or no mixed precision")


def _check_pipeline_launch(args: TrainingArguments, strategy: str) -> None:
    """Pipeline parallelism runs on a DDP launch (ddp.yaml: the stages' replicas sum their gradients) or an FSDP2 one
    (fsdp.yaml: each stage sharded over its replicas), its world a multiple of the stages; the other launch configs
    (ZeRO, FSDP1, a parallelism_config) are refused before any work."""
    pp, world = args.pipeline_parallel_size, launched_world_size()
    if pp == 1:
        return
    fsdp2 = strategy == "fsdp" and os.environ.get("FSDP_VERSION", "1") == "2"
    if strategy not in ("ddp", "fsdp") or (strategy == "fsdp" and not fsdp2) or launched_parallel_sizes():
        raise ConfigError("pipeline_parallel_size", f"pipeline parallelism runs on ddp.yaml or fsdp.yaml (each "
                                                    "stage replicated, or sharded by FSDP2, over its data-parallel "
                                                    f"ranks); this launch is {strategy}"
                                                    f"{' with a parallelism_config' if launched_parallel_sizes() else ''}"
                                                    f"{'' if strategy != 'fsdp' else ' (FSDP1)'}: launch with "
                                                    "accelerate_configs/ddp.yaml or fsdp.yaml, or set "
                                                    "pipeline_parallel_size 1")
    if world % pp:
        raise ConfigError("pipeline_parallel_size", f"{pp} stages do not divide the {world} launched processes: "
                                                    f"launch a multiple of {pp} (--num_processes {pp} or {2 * pp})")


def _quiet_deprecated_collectives() -> None:
    # DeepSpeed 0.19.8's ZeRO-3 calls torch.distributed.all_gather_into_tensor and reduce_scatter_tensor, deprecated
    # in torch 2.13 (use *_single): a FutureWarning per call site per rank (18 lines x 2 in a 2-step run on 2 ranks),
    # glued to the progress bar, about code the user does not own (docs/pitfalls.md#deepspeed-import).
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


def _honour_zero3_init_flag(accelerator: Accelerator) -> None:
    # accelerate registers its DeepSpeed config with transformers whatever zero3_init_flag says, and transformers then
    # builds every model under ZeRO-3 inside deepspeed.zero.Init. Pretrained weights load the same, but a model built
    # from a config gets a different random initialisation than under DDP from the same seed (measured: 0.36 off
    # after 3 SGD steps). With zero3_init_flag: false we take the flag at its word: each rank builds the full model
    # once, exactly as under DDP, and deepspeed.initialize shards it in prepare().
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    plugin = accelerator.state.deepspeed_plugin
    if plugin.zero_stage == 3 and not plugin.zero3_init_flag:
        from transformers.integrations import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


# Every process group this process made, kept until the process ends (see keep_process_groups).
_KEPT_GROUPS: list = []


def keep_process_groups() -> None:
    """Hold a reference to every process group of this process until it exits, so that a group's C++ object is
    never destroyed while the process runs Python.

    ``destroy_process_group`` only forgets a group; the object dies with its last reference, usually the DDP
    reducer's, when the trained model is freed (``train`` returning). ``~ProcessGroupGloo`` then joins gloo's worker
    threads while that thread holds the GIL, and a worker still holding the last reference to a finished
    collective's output (a tensor Python made: freeing it takes the GIL) waits for the GIL forever: a deadlock
    (docs/pitfalls.md#gloo-teardown-deadlock; the quickstart notebook's ``notebook_launcher`` cell hung in 2 of 5
    executions, rank 1 stuck there). A kept group dies with the process: ``toolkit.cli.recipe`` ends a launched rank with
    ``os._exit``, and a ``notebook_launcher`` worker ends as every forked ``multiprocessing`` child does."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {}) or [dist.group.WORLD]
    _KEPT_GROUPS.extend(g for g in groups if not any(g is kept for kept in _KEPT_GROUPS))


def _destroy_process_group() -> None:
    # A script that ends without accelerator.end_training() leaves the gloo process group alive at interpreter exit,
    # and torch then aborts now and then ("terminate called without an active exception", exit -6; measured 1 in 4
    # launches of tests/scripts/order_probe.py). Tearing it down first makes every exit clean.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if _KEPT_GROUPS:  # train() kept them: they die with the process (toolkit.cli.recipe ends it with os._exit)
            keep_process_groups()
        dist.destroy_process_group()  # otherwise the group dies here, while the interpreter is whole


def _check_mixed_precision(asked: str | None) -> None:
    # accelerate ignores fp16 on a CPU-only host, silently: the run trains in plain fp32 and exits 0 (measured: losses
    # bit-identical to fp32). bf16 does run there (autocast on CPU).
    asked = asked or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if asked == "fp16" and not has_accelerator():
        raise ConfigError(
            "mixed_precision",
            "fp16 needs a GPU and this machine has none (accelerate would silently train in fp32); use "
            "--mixed_precision bf16 (autocast on CPU) or no",
        )


def _check_skip_nonfinite(args: TrainingArguments, strategy: str) -> None:
    # DeepSpeed's engine steps inside backward(), before the loop can read the norm: a non-finite step is applied
    # already (fp16 overflows aside, which its loss scaler skips by itself: docs/pitfalls.md#deepspeed-fp16-overflow).
    if args.skip_nonfinite_steps and strategy == "deepspeed":
        raise ConfigError(
            "skip_nonfinite_steps",
            "cannot be honoured under DeepSpeed: its engine applies a step before the norm is known (a non-finite "
            "norm stops the run after that step; fp16 overflows are skipped by its loss scaler anyway); set it to "
            "false, or launch with a DDP or FSDP config",
        )


# optim muon runs its Newton-Schulz on whole matrices: plain tensors, or the DTensors of FSDP2, HSDP and TP, each
# gathered to one owner rank (toolkit.training.newton_schulz); proven equal to one process there
# (tests/launch/test_muon.py). DeepSpeed
# ZeRO hands the optimizer flat 1-D partitions (DeepSpeed 0.19.8's own Muon is another update: a Gram Newton-Schulz
# in fp16/bf16 by default, docs/strategies.md#muon), FSDP1 flat shards.
MUON_LAUNCHES = ("single", "ddp", "fsdp2", "tp")  # fsdp2: hsdp.yaml's too


def _check_muon_launch(args: TrainingArguments) -> None:
    name = launched_strategy_name()
    if args.optim == "muon" and name not in MUON_LAUNCHES:
        raise ConfigError("optim", f"muon runs on one process, ddp.yaml, fsdp.yaml (FSDP2), hsdp.yaml or tp.yaml; "
                                   f"this launch is {name}: launch with one of those, or use optim adamw_torch")


def _layout_name(args: TrainingArguments) -> str:
    """The launch's strategy name, or what splits the model beyond it (a parallelism_config launch: HSDP, TP; a
    pipeline), for the switches proven on plain strategies only (async_save, torch_compile)."""
    if launched_parallel_sizes():
        return "a parallelism_config launch"
    return "pipeline parallelism" if args.pipeline_parallel_size > 1 else launched_strategy_name()


def _check_async_save(args: TrainingArguments) -> None:
    # The asynchronous writer (toolkit.checkpointing.checkpoint.AsyncSaves) stages the weights and the optimizer state
    # through torch.distributed.checkpoint's get_state_dict: proven under DDP and FSDP2 (and one process) only.
    # DeepSpeed writes its own files from its engine; FSDP1, HSDP, TP and pipelines are not tested with it.
    name = _layout_name(args)
    if args.async_save and name not in ("single", "ddp", "fsdp2"):
        raise ConfigError("async_save", f"runs under DDP and FSDP2 only, not {name}; set async_save: false, or launch "
                                        "with ddp.yaml or fsdp.yaml")
    if args.async_save and args.optim == "muon":  # DCP's get_state_dict of the two-optimizer wrapper: not tested
        raise ConfigError("async_save", "with optim muon is not proven yet: set async_save: false (muon's checkpoints "
                                        "are written synchronously), or use another optim")


def _check_torch_compile(args: TrainingArguments) -> None:
    # Per-block compile (toolkit.models.loading.compile_blocks, before fully_shard as torchtitan does: FSDP2's hooks
    # are dynamo-disabled, so the all-gathers run eagerly between the compiled blocks) is proven bitwise (aot_eager) on
    # one process, DDP and FSDP2 (tests/unit/test_compile.py, tests/launch/test_strategies.py). ZeRO's hooks, FSDP1's
    # flat parameters, TP's DTensors and a pipeline's stages are not tested with it, nor is checkpointing around a
    # compiled layer.
    name = _layout_name(args)
    if args.torch_compile and name not in ("single", "ddp", "fsdp2"):
        raise ConfigError("torch_compile", f"runs on one process, under DDP and FSDP2 only, not {name}; set "
                                           "torch_compile: false, or launch with ddp.yaml or fsdp.yaml")
    if args.torch_compile and args.gradient_checkpointing:
        raise ConfigError("torch_compile", "with gradient_checkpointing is not proven here; set one of them to false")
    if args.torch_compile and os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true":
        raise ConfigError("torch_compile", "with the launch config's fsdp_activation_checkpointing is not proven "
                                           "here; set torch_compile: false or fsdp_activation_checkpointing: false")


def _check_accumulation_env(args: TrainingArguments) -> None:
    # `accelerate launch` copies a gradient_accumulation_steps found in the config's DeepSpeed section into this
    # variable, and the Accelerator then prefers it over the argument we pass, silently
    # (docs/pitfalls.md#deepspeed-accumulation).
    value = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if value not in (None, "", "auto") and int(value) != args.gradient_accumulation_steps:
        raise ConfigError(
            "gradient_accumulation_steps",
            f"the accelerate config sets {value} (deepspeed_config.gradient_accumulation_steps) but the recipe "
            f"says {args.gradient_accumulation_steps}; delete it from the accelerate config: the recipe owns it",
        )


def configure_deepspeed(accelerator: Accelerator, args: TrainingArguments, load_universal: bool = False) -> None:
    """Fill the DeepSpeed config from the recipe before ``prepare``, refusing values that contradict it.
    ``load_universal``: the resume loads a universal checkpoint (``toolkit.checkpointing.convert``), which the engine must know."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    ds = accelerator.state.deepspeed_plugin.deepspeed_config

    def agree(key, want, field_name):
        have = ds.get(key, "auto")
        if have in ("auto", None):
            ds[key] = want
        elif float(have) != float(want):
            raise ConfigError(
                field_name,
                f"the DeepSpeed config sets {key}={have} but the recipe says {want}; "
                f"set it to 'auto' (or remove it) in the accelerate config",
            )

    # Our DataLoader is driven by a batch sampler, so accelerate cannot read a batch size off it.
    agree("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size")
    agree("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    # DeepSpeed clips inside engine.step(); 0 means off since accelerate 1.16 (no key would mean 1.0).
    agree("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    ds["train_batch_size"] = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
    )
    if load_universal:
        ds["checkpoint"] = {**ds.get("checkpoint", {}), "load_universal": True}
    zero = ds.setdefault("zero_optimization", {})
    if args.save_final_model and zero.get("stage") == 3 and not zero.get("stage3_gather_16bit_weights_on_model_save"):
        # Without it the final export of a ZeRO-3 model fails after all the compute (accelerate injects false when the
        # launch config says nothing); gathering the full weights once at the end is what save_final_model asks for.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        accelerator.print("ZeRO-3: zero3_save_16bit_model turned on, so that final/ can hold the full weights")
    offload = zero.get("offload_optimizer", {}).get("device", "none")
    if offload not in (None, "none") and not args.optim.startswith("adamw"):
        # With the optimizer offloaded, accelerate swaps *any* torch optimizer for DeepSpeedCPUAdam
        # (map_pytorch_optim_to_deepspeed): SGD silently becomes Adam (measured: 1.5 off after 3 steps). Only AdamW
        # has a faithful CPU twin; anything else runs as the recipe's own torch optimizer on the CPU partitions.
        ds["zero_force_ds_cpu_optimizer"] = False


CHECKPOINTING_TWICE = ("the launch config already sets fsdp_activation_checkpointing: true, which checkpoints every "
                      "layer; set gradient_checkpointing: false (or turn the FSDP option off)")


def _check_activation_checkpointing(args: TrainingArguments) -> None:
    """Activation checkpointing asked twice (the field and the FSDP launch config's option) is refused from the
    launch's environment, before the process group and the weights (and by ``toolkit train`` before it launches);
    ``resolve_activation_checkpointing`` refuses it again from the plugin, for an Accelerator made otherwise."""
    if args.gradient_checkpointing and launched_strategy() == "fsdp" and _env_true("FSDP_ACTIVATION_CHECKPOINTING"):
        raise ConfigError("gradient_checkpointing", CHECKPOINTING_TWICE)


def resolve_activation_checkpointing(accelerator: Accelerator, gradient_checkpointing: bool) -> bool:
    """Whether the model should use transformers' activation checkpointing: the recipe's field, or FSDP's own option
    (``fsdp_activation_checkpointing`` in the launch config), which is then handed over to transformers.

    accelerate applies the FSDP option by wrapping every decoder layer in torch's ``checkpoint_wrapper``, whose
    recompute calls the layer without the keyword arguments transformers 5 passes it (measured, GPT-2 with an
    attention mask: ``RuntimeError: The size of tensor a (66) must match the size of tensor b (33)`` in the
    backward). transformers' own checkpointing recomputes the same layers with their arguments. Asked twice (field
    and launch config) is refused: set one.
    """
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    from_launch_config = plugin is not None and plugin.activation_checkpointing
    if gradient_checkpointing and from_launch_config:
        raise ConfigError("gradient_checkpointing", CHECKPOINTING_TWICE)
    if from_launch_config:
        plugin.activation_checkpointing = False  # done by transformers instead (see above)
        accelerator.print("fsdp_activation_checkpointing: each decoder layer is recomputed in the backward pass "
                          "(through transformers' activation checkpointing)")
    return gradient_checkpointing or from_launch_config


def keep_embeddings_out_of_fsdp_units(accelerator: Accelerator, model) -> None:
    """Under FSDP2, wrap only the model's ``_no_split_modules`` classes that do not hold its input or output embedding.

    accelerate shards every ``_no_split_modules`` class, then carves the input embedding into a unit of its own.
    For BERT, ``_no_split_modules`` names ``BertEmbeddings``, the parent of the word embeddings, whose weight is a
    DTensor by then, and ``fully_shard`` fails on it (measured, accelerate 1.16: ``TypeError: Invariant
    encountered: value was None``, for every BERT-family classifier, with or without LoRA). Leaving those parent
    classes out gives the embedding its own unit, as for decoder models; the rest of the parent joins the root
    unit. A class list the user set in the launch config (``fsdp_transformer_layer_cls_to_wrap``) is kept as is.
    """
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or plugin.fsdp_version != 2 or plugin.transformer_cls_names_to_wrap is not None:
        return
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = plugin.auto_wrap_policy
    if getattr(policy, "func", policy) is not transformer_auto_wrap_policy:
        return
    embeddings = [getattr(model, name, lambda: None)() for name in ("get_input_embeddings", "get_output_embeddings")]
    embeddings = [e for e in embeddings if e is not None]
    holders = set()  # class names of every module above an embedding
    for name, module in model.named_modules():
        if any(module is e for e in embeddings):
            parts = name.split(".")
            holders |= {type(model.get_submodule(".".join(parts[:i]))).__name__ for i in range(len(parts))}
    names = [n for n in (getattr(model, "_no_split_modules", None) or []) if n not in holders
             and any(type(m).__name__ == n for m in model.modules())]
    plugin.transformer_cls_names_to_wrap = sorted(names)


def data_parallel_size(accelerator: Accelerator) -> int:
    """Ranks that take different rows of a global batch: dp_replicate x dp_shard under a ParallelismConfig (the
    ranks of one tensor-parallel group take the same rows), otherwise every process."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None:  # the stages of one pipeline take the same rows, and so do a sequence-parallel group's ranks
        return accelerator.num_processes // (getattr(accelerator, "pipeline_parallel_size", 1)
                                             * getattr(accelerator, "sequence_parallel_size", 1))
    return config.dp_replicate_size * config.dp_shard_size


def data_parallel_rank(accelerator: Accelerator) -> int:
    """This rank's index among the data-parallel ranks: accelerate's mesh puts tensor (and context) parallelism
    innermost, so the ranks of one TP group are consecutive and share it."""
    return accelerator.process_index // (accelerator.num_processes // data_parallel_size(accelerator))


def gather_for_metrics(accelerator: Accelerator, rows):
    """accelerate's ``gather_for_metrics`` of per-row tensors (nested tuples/lists/dicts), over the data-parallel ranks
    only: each validation row once.

    Under tensor parallelism accelerate's eval loader gives every rank of a TP group the same batches, but its
    ``gather_for_metrics`` gathers over every rank and cuts the last batch to a remainder computed for the
    data-parallel degree: each row counted about tp times (docs/pitfalls.md#tp-eval-gather). Without TP this is
    accelerate's own, unchanged.
    """
    # Under sequence parallelism evaluation is not split (toolkit.parallel.sequence): every rank its own rows.
    if accelerator.num_processes == data_parallel_size(accelerator) or getattr(accelerator, "sequence_parallel_size",
                                                                               1) > 1:
        return accelerator.gather_for_metrics(rows)
    if data_parallel_size(accelerator) > 1:  # dp x tp is refused before work (check_parallelism): never run here
        raise RuntimeError("evaluation under tensor parallelism with data parallelism is not supported")
    # TP alone: the data-parallel group is this rank, which holds every row (as each rank of its TP group does). The
    # last batch is cut as accelerate cuts it: its loader pads it to a full batch with rows from the start of the set.
    from accelerate.utils import recursively_apply

    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        rows = recursively_apply(lambda tensor: tensor[: state.remainder], rows)
    return rows


def tensor_parallel_size(accelerator: Accelerator) -> int:
    config = getattr(accelerator, "parallelism_config", None)
    return config.tp_size if config is not None else 1


def check_parallelism(accelerator: Accelerator) -> None:
    """Refuse, before the weights load, the ParallelismConfig combinations these versions cannot run."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None:
        _refuse_parallel_sizes(config.tp_size, config.dp_shard_size, config.dp_replicate_size, config.cp_size)


def _refuse_parallel_sizes(tp: int, dp_shard: int, dp_replicate: int, cp: int) -> None:
    """What ``check_parallelism`` refuses, from the sizes alone: also checked from the launch's environment
    (``check_launch``), so ``toolkit train`` refuses it before it launches."""
    if tp > 1 and dp_shard * dp_replicate > 1:
        # accelerate 1.16's _prepare_tp imports ReplicateParallel from transformers.integrations.tensor_parallel,
        # which transformers 5.24 no longer has (measured: ImportError); via transformers' own DistributedConfig the
        # TP mesh refuses a world larger than tp_size ("The parallel mesh requires 2 processes, but world_size is 4").
        raise ConfigError("parallelism_config_tp_size", f"tensor parallelism (tp_size {tp}) with data "
                                                        f"parallelism (dp_shard_size {dp_shard}, "
                                                        f"dp_replicate_size {dp_replicate}): dp_shard x tp "
                                                        "fails with accelerate 1.16 + transformers 5.24 (ImportError: "
                                                        "ReplicateParallel) and dp_replicate x tp is untested here; "
                                                        "use tp alone (tp.yaml), or HSDP/FSDP without tp")
    if cp > 1:
        raise ConfigError("parallelism_config_cp_size", "context parallelism is not supported by the toolkit yet")


def strategy_name(accelerator: Accelerator) -> str:
    """The checkpoint format family a run writes: 'single', 'ddp', 'fsdp1', 'fsdp2', 'deepspeed-zero<stage>' or 'tp'
    (tensor parallel, which runs alone here (``check_parallelism``): its tp_size is its world size)."""
    if tensor_parallel_size(accelerator) > 1:
        return "tp"
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return f"deepspeed-zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if kind == DistributedType.FSDP:
        return "fsdp2" if accelerator.is_fsdp2 else "fsdp1"
    return "single" if kind == DistributedType.NO else "ddp"


def check_world(accelerator: Accelerator, strategy: str | None = None) -> None:
    """Refuse a silent fallback: the world the launcher started must be the one accelerate sees."""
    strategy = strategy or launched_strategy()
    expected = launched_world_size()
    if accelerator.num_processes != expected:
        raise RuntimeError(
            f"launched {expected} processes but the Accelerator sees {accelerator.num_processes} "
            f"(distributed_type={accelerator.distributed_type}); each rank would train alone on all the data. "
            "Check the accelerate config and that the process group came up."
        )
    want = {"deepspeed": DistributedType.DEEPSPEED, "fsdp": DistributedType.FSDP}.get(strategy)
    if want is not None and accelerator.distributed_type != want:
        raise RuntimeError(
            f"the launch config asks for {strategy} but the Accelerator runs {accelerator.distributed_type}; "
            "refusing to train with a different strategy than configured."
        )


def unwrap(model):
    """The module under DDP's or DeepSpeed's wrapper (an FSDP2 module is the model itself)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
        return model.module
    return model


def notebook_launcher(function, args=(), num_processes=None, **kwargs):
    """accelerate's ``notebook_launcher``, less one false refusal. accelerate refuses to fork while ``bitsandbytes`` is
    imported, as a stand-in for "CUDA may be initialised in this process"; but transformers' schedulers import peft
    (``transformers.trainer_utils``), which imports bitsandbytes wherever it is installed (the ``qlora`` extra), so any
    run in the kernel before the launch trips it, on a CPU host too (docs/pitfalls.md#notebook-bitsandbytes). The
    condition itself is checked instead: CUDA initialised in this process (a forked child cannot use its context)."""
    import torch
    from accelerate import launchers

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in this kernel, and the launch forks it (a forked child cannot use "
                           "the context): restart the kernel and keep device work inside the launched function")
    check = launchers.are_libraries_initialized
    launchers.are_libraries_initialized = lambda *names: [n for n in check(*names) if n != "bitsandbytes"]
    try:
        return launchers.notebook_launcher(function, args, num_processes, **kwargs)
    finally:
        launchers.are_libraries_initialized = check
