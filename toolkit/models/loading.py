"""Loading the tokenizer and the model (a causal LM unless the task says otherwise): pretrained
(``model_name_or_path``) or from a config (``config_name``)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from contextlib import contextmanager

import torch
import transformers
from transformers import AutoTokenizer

from toolkit import layout
from toolkit.config import ModelArguments, max_positions
from toolkit.env import hub, upstream
from toolkit.errors import ConfigError

# before transformers' modeling code loads (the imports above do not load it): without scipy.optimize
upstream.import_transformers_losses()

__all__ = ["load_config", "load_tokenizer", "load_model", "disable_dropout", "max_positions", "plain_loading"]


def _unreachable(field_name: str, name: str, err: OSError, offline: str | None = None) -> ConfigError:
    # transformers raises OSError for a name that is neither a local folder nor reachable on the Hub (offline, a
    # typo, a private repo); four chained tracebacks otherwise. ``offline``: why the Hub was not asked (toolkit.env.hub).
    if offline:
        return ConfigError(field_name, f"cannot load {name!r}: {hub.not_cached(name, offline)}")
    reason = str(err).strip().splitlines()[0][:200]
    return ConfigError(field_name, f"cannot load {name!r}: not a local folder, and the Hub could not provide it "
                                   f"({reason}); check the name, or download it and pass the local folder")


def load_config(args: ModelArguments, disable_dropout: bool = False):
    """The model's config (``ModelArguments.auto_config``: config_overrides applied), a name the Hub cannot provide
    refused as a ConfigError (at once when the Hub is unreachable: toolkit.env.hub); ``disable_dropout``: every dropout
    rate in it 0."""
    offline = hub.offline_if_unreachable(args.config_source)
    try:
        config = args.auto_config()
    except OSError as e:
        raise _unreachable("config_name" if args.config_name else "model_name_or_path", args.config_source, e,
                           offline) from None
    check_attn_implementation(args.attn_implementation)
    if disable_dropout:
        # Every float hyperparameter named like a dropout rate (GPT-2's *_pdrop, Llama's attention_dropout, BERT's
        # hidden_dropout_prob, ...): some models apply dropout functionally from these, with no nn.Dropout to reach.
        for key, value in list(vars(config).items()):
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(config, key, 0.0)
    return config


def check_attn_implementation(name: str | None) -> None:
    """Refuse, before the weights load, an attention implementation that this installation cannot run."""
    from transformers.utils import import_utils

    available = {"flash_attention_2": import_utils.is_flash_attn_2_available,
                 "flash_attention_3": import_utils.is_flash_attn_3_available}
    if name is None or name in ("eager", "sdpa"):
        return
    if name in available:
        if not available[name]():
            raise ConfigError("attn_implementation", f"{name} needs its flash-attn package and a CUDA GPU, not found "
                                                     "here; install it, or use a kernel of the Hub "
                                                     "(kernels-community/flash-attn, pip install kernels), or sdpa")
    elif "/" in name and importlib.util.find_spec("kernels") is None:  # other names: checked at parse time
        raise ConfigError("attn_implementation", f"{name!r} is a kernel of the Hub, loaded by the kernels package, "
                                                 "which is not installed; pip install kernels, or use sdpa")


def disable_dropout(model: torch.nn.Module) -> None:
    """p = 0 on every ``nn.Dropout`` (TRL's ``disable_dropout_in_model``); ``load_config`` covers the functional
    ones."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def load_tokenizer(args: ModelArguments, log=print):
    name = args.tokenizer_name or args.model_name_or_path or args.config_name
    kw = args.pretrained_kwargs() if name == args.model_name_or_path else {"trust_remote_code": args.trust_remote_code}
    offline = hub.offline_if_unreachable(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **kw)
    except OSError as e:
        field_name = "tokenizer_name" if args.tokenizer_name else (
            "model_name_or_path" if args.model_name_or_path else "config_name")
        raise _unreachable(field_name, name, e, offline) from None
    if tokenizer.pad_token_id is None:
        # GPT-2 has no pad token. Pads are masked out of attention and labelled -100, so which id fills them
        # does not matter; EOS is the usual choice and keeps the vocabulary unchanged.
        if tokenizer.eos_token_id is None:
            raise ConfigError("tokenizer_name", f"{name} has neither a pad nor an EOS token; add a pad token")
        tokenizer.pad_token = tokenizer.eos_token
        log(f"tokenizer {name} has no pad token: using EOS ({tokenizer.eos_token!r}) for padding")
    return tokenizer


@contextmanager
def _load_report_for_stderr():
    """transformers 5's load report (missing, unexpected keys: a classifier's new head) goes to sys.stderr with its
    title always in bold and its statuses coloured when sys.stdout is a terminal: a log file or a captured run held
    raw escape sequences. Inside, the report has no colour unless stderr is a terminal
    (docs/pitfalls.md#load-report)."""
    from transformers.utils import loading_report

    if sys.stderr is not None and sys.stderr.isatty():
        yield
        return
    palette = loading_report.PALETTE
    loading_report.PALETTE = dict.fromkeys(palette, "")  # read by the report's every styled piece, at call time
    try:
        yield
    finally:
        loading_report.PALETTE = palette


def load_model(args: ModelArguments, config=None, auto_class: str = "AutoModelForCausalLM", tp_size: int = 1,
               device=None):
    """Pretrained weights when ``model_name_or_path`` is set, otherwise a fresh model from the config.

    In ``torch_dtype`` (float32 unless asked otherwise): transformers 5 loads a checkpoint in the dtype it was stored
    in, and most Hub releases are stored in bf16, so without this AdamW would update bf16 weights and small updates
    would round away (and ZeRO, which keeps fp32 shards, would disagree with DDP on the same model).
    ``auto_class``: the transformers Auto class of the task (``toolkit.tasks.base``). ``tp_size`` > 1: the weights load
    split over the tensor-parallel ranks by the model's own TP plan (transformers' ``DistributedConfig``).
    ``load_in_4bit`` / ``load_in_8bit``: the base quantized by bitsandbytes on ``device`` (the rank's; CPU when None),
    computing in ``torch_dtype`` (``toolkit.models.quantization``).
    """
    auto = getattr(transformers, auto_class)
    with _load_report_for_stderr():
        if is_adapter_folder(args.model_name_or_path):  # a LoRA run's final/
            check_adapter_model(args, tp_size)  # (build's check_inputs ran it before the data, without the TP size)
            return _load_adapter(args, config, auto_class)
        if tp_size > 1:
            return _load_tensor_parallel(args, config, auto, tp_size)
        if args.load_in_4bit or args.load_in_8bit:
            return _load_quantized(args, config, auto, device)
        return _load(args, config, auto)


ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_folder(name: str | None) -> bool:
    """A local folder holding a LoRA adapter (a LoRA run's ``final/``: adapter_config.json, no full weights)."""
    return bool(name) and os.path.isfile(os.path.join(name, ADAPTER_CONFIG))


def adapter_base_arguments(folder: str) -> ModelArguments:
    """The model fields a LoRA adapter export (``folder``) was trained with: its run's own (the run's config.yaml
    beside ``final/``: the base's path, dtype, quantization and loading fields), or, without it, the adapter's recorded
    base (peft's ``base_model_name_or_path``). A base that is not found is refused, naming both."""
    import dataclasses

    run_config = layout.path(os.path.dirname(os.path.normpath(folder)), layout.CONFIG)
    try:
        if os.path.isfile(run_config):  # the model's fields only: the run's other checks (its output_dir) are not ours
            import yaml

            with open(run_config) as f:
                values = yaml.safe_load(f)
            return ModelArguments(**{f.name: values[f.name] for f in dataclasses.fields(ModelArguments)
                                     if f.name in values})
        with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
            return ModelArguments(model_name_or_path=json.load(f).get("base_model_name_or_path"))
    except ConfigError as e:
        raise ConfigError("model_name_or_path", f"{folder} is a LoRA adapter, loaded onto the base it was trained on, "
                                                f"which cannot be loaded: {e}") from None


def check_adapter_model(args: ModelArguments, tp_size: int = 1) -> str | None:
    """Before the weights load: None when ``model_name_or_path`` is no LoRA adapter folder; otherwise what
    ``load_model`` makes of it (for the log), after refusing what cannot merge it: a base quantized as it loads
    (4 or 8 bits), split as it loads (tensor parallelism) or partitioned as it loads (ZeRO-3's zero3_init_flag)."""
    folder = args.model_name_or_path
    if not is_adapter_folder(folder):
        return None
    from toolkit.env.launcher import launched_strategy

    why = ("a quantized base (load_in_4bit / load_in_8bit) is quantized as it loads" if args.load_in_4bit or
           args.load_in_8bit else "tensor parallelism splits the weights as they load" if tp_size > 1 else
           "zero3_init_flag: true partitions the weights as they load" if launched_strategy() == "deepspeed" and
           os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "").lower() == "true" else None)
    if importlib.util.find_spec("peft") is None:
        why = "that needs peft (pip install 'peft>=0.17')"
    if why:
        raise ConfigError("model_name_or_path", f"{folder} is a LoRA adapter, which loads as its base with the "
                                                f"adapter merged in; {why}: name the merged weights instead, "
                                                "final/merged (a LoRA run writes it with merge_lora: true)")
    base = adapter_base_arguments(folder)
    trained = " (trained on a 4-bit base: dequantized first)" if base.load_in_4bit else (
        " (trained on an 8-bit base: dequantized first)" if base.load_in_8bit else "")
    return (f"model_name_or_path {folder} is a LoRA adapter: loaded as its base {base.model_name_or_path}{trained} "
            "with the adapter merged in, the model that run trained")


def _load_adapter(args: ModelArguments, config, auto_class: str):
    """A LoRA adapter folder as one plain model: its base loaded as its run loaded it (``adapter_base_arguments``; a
    quantized base dequantized into its compute dtype, which is what the adapter trained on, as ``merge_lora`` does),
    the adapter merged in (peft), in ``torch_dtype``. Its ``name_or_path`` is the folder: an adapter trained on top
    records it as its base, so a chain of runs loads back link by link."""
    import copy
    import dataclasses
    import warnings

    from peft import PeftModel

    from toolkit.models import quantization

    folder = args.model_name_or_path
    trained = adapter_base_arguments(folder)
    base_args = dataclasses.replace(args, model_name_or_path=trained.model_name_or_path, gguf_file=trained.gguf_file,
                                    config_name=None, config_overrides=None, use_peft=trained.use_peft, merge_lora=False,
                                    **{f: getattr(trained, f) for f in quantization.BASE_FIELDS})
    config = copy.deepcopy(config if config is not None else load_config(args))  # a quantized load writes into it
    quantization.quiet_cpu_kernel_notice()  # peft imports bitsandbytes where it is installed
    base = load_model(base_args, config=config, auto_class=auto_class)
    if getattr(base, "hf_quantizer", None) is not None:
        base = base.dequantize(dtype=quantization.compute_dtype(trained, config))
    with warnings.catch_warnings():  # two notices of peft 0.21 that ask nothing of a user (pitfalls.md#peft-future-warning)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")  # GPT-2's Conv1D: peft sets it
        merged = PeftModel.from_pretrained(base, folder).merge_and_unload()
    restore_conv1d_layers(merged)
    if args.torch_dtype != "auto":
        merged.to(getattr(torch, args.torch_dtype))
    merged.name_or_path = merged.config._name_or_path = os.path.abspath(folder)
    return merged


def restore_conv1d_layers(model) -> None:
    """Put back, in place, every layer that the architecture builds as GPT-2's ``Conv1D`` (a weight stored (in, out))
    and that transformers' ``dequantize()`` turned into an ``nn.Linear`` (a weight (out, in)): its weight transposed
    back. Written as it was, a non-square weight failed to load and a square one (``attn.c_proj``) loaded transposed,
    silently (docs/pitfalls.md#dequantized-conv1d)."""
    from transformers.pytorch_utils import Conv1D

    reference = empty_model(model.config)
    for name, module in reference.named_modules() if reference is not None else ():
        linear = model.get_submodule(name) if isinstance(module, Conv1D) else None
        if type(linear) is not torch.nn.Linear:
            continue
        with torch.device("meta"):  # no memory, no initialisation: its tensors are the linear's, transposed
            conv = Conv1D(linear.out_features, linear.in_features)
        conv.weight = torch.nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        conv.bias = linear.bias
        model.set_submodule(name, conv)


def _load_quantized(args: ModelArguments, config, auto, device):
    from toolkit.models import quantization

    config = config if config is not None else load_config(args)
    model = auto.from_pretrained(args.model_name_or_path, config=config, dtype=quantization.compute_dtype(args, config),
                                 quantization_config=quantization.bnb_config(args, config),
                                 device_map={"": device if device is not None else "cpu"},
                                 **args.pretrained_kwargs(), **args.model_kwargs())
    quantization.no_cpu_repack(model)
    return model


def _load(args: ModelArguments, config, auto):
    config = config if config is not None else load_config(args)
    dtype = args.torch_dtype if args.torch_dtype == "auto" else getattr(torch, args.torch_dtype)
    if args.model_name_or_path:
        return auto.from_pretrained(args.model_name_or_path, config=config, dtype=dtype, **args.pretrained_kwargs(),
                                    **args.model_kwargs())
    # From a config there is no stored dtype: "auto" means the config's own (float32 unless it says otherwise).
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    return auto.from_config(config, dtype=dtype, trust_remote_code=args.trust_remote_code, **args.model_kwargs())


def empty_model(config, auto_class: str | None = None):
    """The architecture of ``config`` on the meta device: every tensor's name and shape, no memory, no initialisation
    (a 7B Llama in 0.03 s). ``auto_class``: a transformers Auto class (a LoRA export's task); otherwise the class the
    config names (``architectures[0]``, what ``save_pretrained`` wrote). None for a class transformers does not ship
    (remote code). Quantization left out: the layout of the weights as the architecture builds them."""
    import copy

    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, auto_class or (names[0] if names else ""), None)
    if cls is None:
        return None
    with torch.device("meta"):
        return cls.from_config(config) if auto_class else cls._from_config(config)


TP_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


def tensor_parallel_problem(config, tp_size: int) -> str | None:
    """Why the model of ``config`` cannot be split over ``tp_size`` ranks by its transformers TP plan, or None.

    The plan splits q/k/v/o by output rows, whole heads per rank: a split head fails deep inside the first forward
    with a shape error (SmolLM2-135M: 9 heads and 3 KV heads take tp_size 3, not 2). The MLP's widths need not
    divide: transformers 5's column-wise shards (``ColwiseParallel``) leave the last rank a shorter slice."""
    if not getattr(config, "base_model_tp_plan", None):
        return (f"a {config.model_type} model has no tensor-parallel plan in transformers (Llama, Mistral, Qwen and "
                "most recent decoder models have one)")
    heads = {name: getattr(config, name, None) for name in TP_HEAD_COUNTS}
    heads = {name: n for name, n in heads.items() if isinstance(n, int)}
    if all(n % tp_size == 0 for n in heads.values()):
        return None
    counts = ", ".join(f"{name} {n}" for name, n in heads.items())
    divisors = [t for t in range(1, max(heads.values()) + 1) if all(n % t == 0 for n in heads.values())]
    return (f"tp_size {tp_size} does not divide this {config.model_type} model's heads ({counts}): each rank holds "
            f"whole heads, so tp_size must divide each ({', '.join(map(str, divisors))})")


def check_tensor_parallel(args: ModelArguments, config, tp_size: int) -> None:
    """Refuse a tensor-parallel load that cannot work: no pretrained weights to split, or a model whose TP plan
    cannot be cut over ``tp_size`` ranks (``tensor_parallel_problem``)."""
    if not args.model_name_or_path:
        raise ConfigError("model_name_or_path", "tensor parallelism loads pretrained weights split by the model's TP "
                                                "plan; save the model first (save_pretrained) and name its folder")
    problem = tensor_parallel_problem(config, tp_size)
    if problem:
        fix = ("use tp_size 1 (ddp/fsdp/zero configs)" if not getattr(config, "base_model_tp_plan", None) else
               "pick a tp_size that divides each (with --num_processes equal to it)")
        raise ConfigError("parallelism_config_tp_size", f"{problem}; {fix}")


def _load_tensor_parallel(args: ModelArguments, config, auto, tp_size: int):
    from transformers.distributed import DistributedConfig

    check_tensor_parallel(args, config, tp_size)
    dtype = args.torch_dtype if args.torch_dtype == "auto" else getattr(torch, args.torch_dtype)
    return auto.from_pretrained(args.model_name_or_path, config=config, dtype=dtype,
                                distributed_config=DistributedConfig(tp_size=tp_size), **args.pretrained_kwargs(),
                                **args.model_kwargs())


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """transformers' activation checkpointing, non-reentrant (the reentrant form needs inputs that require grad and
    re-runs hooks: torch recommends against it). ``activation_checkpointing_enable`` is 5.x's name (the old
    ``gradient_checkpointing_enable`` warns it goes away in v6). The KV cache is off: a recomputed layer cannot use it.
    """
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


# Model types whose logits are exactly lm_head(last hidden state): no softcapping or logit scale that a chunked loss
# computed from the hidden states would miss (Gemma 2's final_logit_softcapping, Cohere's logit_scale, ...).
CHUNKABLE_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")


def check_chunked_loss(config) -> None:
    """Refuse (before the weights load) a chunked loss for a model whose logits are more than lm_head(hidden)."""
    if config.model_type not in CHUNKABLE_MODEL_TYPES:
        raise ConfigError("loss_chunk_size", f"a {config.model_type} model may transform its logits beyond "
                                             "lm_head(hidden), which a chunked loss would skip; supported: "
                                             f"{', '.join(CHUNKABLE_MODEL_TYPES)}. Set loss_chunk_size: 0")


def enable_chunked_loss(model: torch.nn.Module, chunk_size: int, max_positions: int = 0,
                        max_eval_positions: int = 0) -> None:
    """Make ``model(input_ids, attention_mask, labels=...)`` return per-row loss sums computed ``chunk_size``
    positions at a time (``toolkit.loss.chunked_token_losses``, fused: torch's ``F.linear_cross_entropy`` where the
    head is a plain linear layer, the checkpointed chunks otherwise and for DPO's mean logits) instead of the whole
    micro-batch's logits.

    The instance's own ``forward`` is replaced (not a wrapper module): DDP, FSDP and DeepSpeed call it through their
    usual hooks, and the state dict, the tied weights and ``save_pretrained`` stay those of the model. Without
    ``labels`` (generation) the model's forward runs unchanged; evaluation passes labels too (``CausalLM.eval_rows``),
    so that a run that fits only thanks to the chunked loss also fits its evaluation; with ``mean_logits=True`` (DPO's
    evaluation) also ``row_logit_sum`` (``toolkit.loss.row_logit_sums``). ``max_positions`` /
    ``max_eval_positions``: the most positions a training / evaluation micro-batch can hold (rows x block_size),
    chosen by the module's train/eval mode; every call then runs the same number of chunks, as ZeRO-3's collective
    gathers of the head need.

    GRPO's log-probs: with ``completion_ids`` (rows x width, the last ``width`` tokens of ``input_ids``) instead of
    ``labels``, ``token_logps`` and ``entropy`` (rows x width) of each completion token under the logits divided by
    ``temperature``, from the hidden states of the positions that predict them only
    (``toolkit.loss.chunked_completion_logps``); ``completion_positions``: the most completion tokens a micro-batch
    can hold (rows x max_completion_length), for the chunk count of a head that is not fused.
    """
    import inspect
    import types

    from toolkit.loss import chunked_completion_logps, chunked_token_losses

    check_chunked_loss(model.config)
    original = model.forward

    def forward(self, input_ids=None, attention_mask=None, labels=None, position_ids=None, mean_logits=False,
                row_lengths=None, completion_ids=None, temperature=1.0, completion_positions=0, **kwargs):
        if labels is None and completion_ids is None:
            return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        # position_ids: a packed row's per-document positions (toolkit.data.packing), None for a padded one
        hidden = self.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False).last_hidden_state
        if completion_ids is not None:  # position i predicts token i+1: the width positions before the last
            rows, width = completion_ids.shape
            logps, entropy = chunked_completion_logps(hidden[:, -width - 1:-1].reshape(rows * width, -1),
                                                      self.get_output_embeddings(), completion_ids.reshape(-1),
                                                      chunk_size, temperature,
                                                      num_chunks=-(-completion_positions // chunk_size))
            return {"token_logps": logps.view(rows, width), "entropy": entropy.view(rows, width)}
        positions = max_positions if self.training else max_eval_positions
        out = chunked_token_losses(hidden, self.get_output_embeddings(), labels, chunk_size,
                                   num_chunks=-(-positions // chunk_size), mean_logits=mean_logits,
                                   row_lengths=row_lengths, fused=True)
        return dict(zip(("row_loss", "row_targets", "row_logit_sum"), out))

    # The model class's signature shown (TRL's add_fused_lm_head keeps it too): generate reads it, and without
    # logits_to_keep there its prefill projected every prompt position (rows x prompt x vocab logits) where one is
    # kept. As __signature__, not functools.wraps: accelerate's unwrap_model(keep_fp32_wrapper=False) follows
    # __wrapped__ down to the first function that is no wrapper, which would then be the class's forward.
    forward.__signature__ = inspect.signature(type(model).forward)
    model.forward = types.MethodType(forward, model)


def compile_blocks(model: torch.nn.Module, backend: str | None, mode: str | None,
                   cache_dir: str | None = None, dynamic: bool = True) -> int:
    """``torch_compile``: compile each decoder block in place (``nn.Module.compile``, torchtitan's per-block compile),
    the model's ``_no_split_modules`` classes. In place, so that the state dict keeps its names (``torch.compile(model)``
    would add ``_orig_mod.``) and the checkpoints of a compiled run are those of an eager one. ``dynamic=True``: the
    batch and sequence dimensions are symbolic from the first call, so every padded length and micro-batch size
    reuses one graph (per grad mode and attention mask present or absent; a dimension of size 1 is specialised).
    Without it dynamo's automatic dynamic shapes compiled a static graph for the first length and then a dynamic one
    (a compile more), and which graphs a process compiled depended on the shapes it had seen before, so the cache of
    a 2-rank run did not serve a one-process run (tests/launch/test_strategies.py, docs/performance.md). Under FSDP2
    (``dynamic=False``: automatic dynamic shapes, as before) symbolic shapes over its sharded parameters made the
    compile about twice as slow although it compiled 3 graphs instead of 8 (measured: 38 s against 19 s for the
    launch). Returns the number of blocks compiled (``compiled_graphs``: the graphs)."""
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)  # read when inductor first compiles
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    for block in blocks:
        block.compile(backend=backend or "inductor", mode=mode, dynamic=True if dynamic else None)
    return len(blocks)


def compiled_graphs() -> str:
    """What the log says at a compiled run's end: the graphs dynamo compiled in this process so far, and how many of
    inductor's compiled graphs came from its cache (``torch_compile_cache_dir``: a restart that finds its graphs there
    does not compile them again) or were compiled afresh."""
    from torch._dynamo.utils import counters

    said = f"{int(counters['stats']['unique_graphs'])} graphs compiled in this process"
    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    return said + (f" (inductor's cache: {hits} hits, {misses} misses)" if hits or misses else "")


def parameter_dtypes(model: torch.nn.Module) -> str:
    """'float32', or e.g. 'bfloat16+float32' when a model holds several (for the log)."""
    return "+".join(sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()}))


@contextmanager
def plain_loading(accelerator):
    """Load a model whole in this one process, also inside a ZeRO-3 launch (whose ``zero.Init`` would otherwise
    partition it across ranks that are not loading it)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        yield
        return
    with plugin.zero3_init_context_manager(enable=False):
        yield
