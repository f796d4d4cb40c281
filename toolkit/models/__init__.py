"""Models: what loads, adapts and answers, one process at a time (no Accelerator here).

  quantization  a frozen base in 4 or 8 bits (bitsandbytes: QLoRA), its checks and storage; 8-bit AdamW
  loading       tokenizer and model loading (tensor-parallel too), disable_dropout, loading whole under ZeRO-3
  lora          LoRA through peft: wrap, adapter and merged export, loading an export back
  generation    a model's greedy answer to a chat's prompt (the SFT recipe's look before and after)
  offline       real GPT-2 tokenizer and SmolLM2 weights without the Hub (``toolkit offline NAME DIR``)
May import: errors, loss, env, config.
"""
