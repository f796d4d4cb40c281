"""toolkit: fine-tuning on Hugging Face Accelerate; the same recipe under DDP, DeepSpeed ZeRO-2/3 and FSDP.

Modules, one job each (a module imports only modules above it in this list; ``tests/unit/test_imports.py`` keeps it
so, and that every module is listed). Layers, bottom first: what a config needs (standard library and yaml); data,
models and the distributed setup; the tasks; checkpoints; building a run; the loop and its records; the commands.
  errors        ConfigError, the one user-facing error (no imports)
  layout        the names of a run folder's files, cheap reads of it (standard library only)
  state         LoopState (the loop's position, saved in every checkpoint) and StepResult (no imports)
  elastic       torch elastic restarts: the launcher's environment, and a restart continuing its run (errors, layout)
  config_help   a recipe's --help (its fields grouped), which recipe takes a field, a field the task ignores refused
  config_checks  the small checks the argument classes share (_positive, _one_of, ...), a field's task tuples
  config_mixture  dataset_mixture's check (alignment-handbook's shape), the local files a mixture id names
  config_quantization  quantization's fields (load_in_4bit, ...) and checks, a part of ModelArguments
  config_grpo   GRPO's fields (sampling, clipping, rewards) and checks, a part of TrainingArguments
  config_preference  beta and loss_type (DPO and GRPO), DPO's precompute_ref_log_probs, a part of TrainingArguments
  config_pipeline  pipeline parallelism's fields and checks, a part of TrainingArguments
  config_classification  label_column_name and class_weights, a part of DataArguments
  upstream      import costs underneath, avoided: transformers' model files read once, its losses without scipy
  config_parsing  YAML + command line -> argument dataclasses through HfArgumentParser; one error per mistake
  config        the argument dataclasses (every field, each class naming its parts), RunConfig's checks of the whole
  hub           whether the Hugging Face Hub answers (once per process); offline, Hub names fail at once
  loss          token-sum loss normalised over the accumulated global batch
  packing       padding-free packing: best-fit-decreasing rows of documents, one flattened row per micro-batch, the guard
  data          loading (Hub, local files, the embedded 'pydoc' text), tokenization, packing, padding
  formats       dataset formats (TRL's, Alpaca, ShareGPT) detected from the columns, converted to a task's schema
  mixture       a task's raw splits: one dataset, or several mixed (dataset_mixture, alignment-handbook's shape)
  order         the global sample order (independent of world size and accumulation)
  stream        the same order for a stream (streaming: true): shuffled windows, g % dp per rank, exact resume
  distributed   the Accelerator, the CPU shim for DeepSpeed/FSDP/TP on gloo, data-parallel and TP degrees
  clipping      the global gradient norm and clipping, exact on a CPU (torch's fp32 CPU norm kernel is not)
  quantization  a frozen base in 4 or 8 bits (bitsandbytes: QLoRA), its checks and storage; 8-bit AdamW
  model         tokenizer and model loading (tensor-parallel too), disable_dropout
  lora          LoRA through peft: wrap, adapter and merged export, loading an export back
  builtin_data  offline sets: pydoc-chats (chat SFT), stdlib-docstrings (classification)
  sampling      per-row seeded sampling through model.generate: a completion depends on (seed, step, prompt, index)
  grpo_loss     GRPO's arithmetic (TRL's): completion log-probs, group advantages, the clipped surrogate, loss_types
  rewards       GRPO's reward functions (import paths, TRL's signature), the built-in arithmetic set and rewards
  tasks         what a recipe trains: the Task interface (data, model class, row loss, metrics) and CausalLM
  chat          chat data: the chat template, the assistant-only label mask; the ChatSFT task
  classification  labels, class weights, per-example loss, accuracy and macro-F1; the SequenceClassification task
  reference     DPO's reference model: a live frozen copy sharded like the policy, the adapter disabled, or a whole copy
  preference    preference pairs (prompt, chosen, rejected), the DPO loss against reference log-probs; the DPO task
  grpo          GRPO: prompts -> sampled completions (the per-step hook), rewards, group advantages; the GRPO task
  pipeline      pipeline parallelism: a causal LM cut into stages, torch's schedules, the pp x dp step
  checkpointing.convert  a checkpoint converted for a launch that cannot load it as written (DeepSpeed universal)
  checkpointing.resume  what a checkpoint records about the sample order; refuses a resume that would change it
  checkpointing.staged  a pipeline's checkpoint: its stages written as (and read from) one process's files, by name
  checkpointing.checkpoint  save_state checkpoints (atomic, rotated), their exact load, the final export
  checkpointing.manager  plan_resume (once, before the weights load) and Checkpointer (the loop's load and save)
  checkpointing  the package: Checkpointer, ResumePlan, plan_resume
  build         everything a run trains on, from a config (recipes and the notebook share it)
  generation    a model's greedy answer to a chat's prompt (the SFT recipe's look before and after)
  preemption    SIGTERM -> every rank finishes the step, saves a checkpoint and stops
  accounting    FLOPs per token, MFU, peak memory per rank
  metrics       metrics.jsonl (write and read), the log window, summary.json, trackers, progress bar
  plots, report  loss.png; ``python -m toolkit report`` (readers of finished runs)
  host_memory   CPU ranks keep freed memory for reuse (glibc mallopt)
  loop          train_step (one optimizer step) and train (the outer loop), evaluation
  cli           a recipe's main as a process: a ConfigError is one line and exit 2; no teardown on launched ranks
  launch        ``toolkit train TASK``: the whole configuration checked in this process, then ``accelerate launch``
  verify        ``python -m toolkit verify``: a launch config against one process
  plan          ``python -m toolkit plan``: which strategy fits, per device
  talk          ``python -m toolkit chat DIR``: talk to an exported model through its chat template
  offline       real GPT-2 tokenizer and SmolLM2 weights without the Hub
Imports stay lazy here so ``python -m toolkit.<module>`` and the notebook start fast.
"""

__version__ = "0.1.0"
