"""toolkit: fine-tuning on Hugging Face Accelerate; the same recipe under DDP, DeepSpeed ZeRO-2/3 and FSDP.

Modules, one job each:
  config        dataclasses, YAML + CLI parsing, validation before any expensive work
  data          loading (Hub, local files, the embedded 'pydoc' text), tokenization, packing, padding
  order         the global sample order (independent of world size and accumulation)
  loss          token-sum loss normalised over the accumulated global batch
  distributed   the Accelerator, and the CPU shim for DeepSpeed/FSDP on gloo
  loop          the training loop and evaluation
  checkpoint    save_state checkpoints, resume, final export
  metrics       metrics.jsonl, trackers, progress bar
  offline       real GPT-2 tokenizer and SmolLM2 weights without the Hub
Imports stay lazy here so ``python -m toolkit.<module>`` and the notebook start fast.
"""

__version__ = "0.1.0"
