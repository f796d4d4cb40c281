"""toolkit: fine-tuning on Hugging Face Accelerate; the same recipe under DDP, DeepSpeed ZeRO-2/3, FSDP, TP and pipelines.

The house, one folder per concern, bottom first: a module imports only what is listed above it (each subpackage's
docstring lists its own modules the same way, and a package's ``__init__`` comes after its modules);
``tests/unit/test_imports.py`` keeps it so, and that every module is listed, and the wheel holds every folder.
  errors         ConfigError, the one user-facing error (no imports)
  layout         the names of a run folder's files, cheap reads of it (standard library only)
  loss           token-sum loss normalised over the accumulated global batch
  env            what surrounds a process: the launcher's environment, elastic restarts, the Hub, import costs, memory
  config         the argument dataclasses, parsing, --help and every check of a config (no torch: checked first)
  data           raw rows to batches: loading, formats, mixtures, the sample order, streams, packing, chat templates
  models         tokenizer and model loading, LoRA, quantization, generation, the offline models
  parallel       the Accelerator and its CPU shims, exact gradient clipping, pipeline parallelism
  tasks          what a recipe trains: the Task interface; lm, sft, classification, dpo (+ reference), grpo
  checkpointing  checkpoints: save, exact resume, conversion between launches, the final export
  reporting      what a run records and what reads it back: FLOPs and memory, metrics, plots, ``toolkit report``
  training       a run built from a config, the loop (train_step and train), its state, preemption
  cli            the commands: a recipe's main, ``toolkit train``, ``verify``, ``plan``, ``chat``
Imports stay lazy here (each ``__init__`` holds a docstring, ``config``'s and ``checkpointing``'s their public names)
so that ``python -m toolkit <command>`` and a notebook start fast.
"""

__version__ = "0.1.0"
