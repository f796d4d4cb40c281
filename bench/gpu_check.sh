#!/usr/bin/env bash
# One prepared check for a lent GPU: GPT-2 124M (12 x 768, random init, OpenAI's real BPE, no Hub) trained in bf16 on
# one device for a few steps through the real recipe; prints tokens/s, MFU and peak memory, then what
# `toolkit plan` predicts for the same job; then, on a GPU only (a CPU refuses fp16), the same model in fp16 with
# dynamic loss scaling under DDP (a GradScaler) and under DeepSpeed ZeRO-2 (its fp16 engine): overflow steps are
# skipped and counted (skipped_steps), the run ends with a finite loss (docs/pitfalls.md#fp16-overflow-norm).
# Then padding-free packing (docs/performance.md#padding-free-packing): the same model on the pydoc paragraphs, one
# per row padded against whole paragraphs packed best-fit decreasing (packing_strategy bfd), real tokens/s and fill rate;
# then, where flash-attention is installed (the flash-attn package, or the kernels package with
# kernels-community/flash-attn in its cache: the device has no network), the same bfd run with it: each packed
# micro-batch is one flattened row, so flash finds the documents (cu_seqlens) and the guard passes; its loss must match
# the sdpa bfd run's.
# Then QLoRA (docs/memory.md#qlora): SmolLM2-135M (offline, from its GGUF) in 4 bits (NF4, double quantization, bf16
# compute and storage) under FSDP2, LoRA r=16 on every linear layer; tokens/s, peak memory and the loss it ends at.
# Then, with 2 GPUs or more, the sequence split (docs/strategies.md#sequence-parallelism): the same GPT-2 in fp32 with
# SGD on padded rows of varied length, one process against Ulysses 2 (sequence_parallel_size) and the ring 2
# (context_parallel_size: the memory-efficient attention kernels on CUDA, NCCL's sends), final weights within 1e-5.
# Then torch_compile: GPT-2 124M bf16 with and without inductor-compiled blocks, tokens/s and MFU (GPU only).
# Not part of CI. On a CPU it runs too (slowly: use 2 steps, micro 1), the fp16 part left out.
#   bench/gpu_check.sh [steps=30] [micro_batch=8]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-30}
MICRO=${2:-8}
WORK=${WORK:-/tmp/toolkit-gpu-check}
mkdir -p "$WORK"
python -m toolkit offline tiny-gpt2 "$WORK/gpt2-124m" --n-layer 12 --n-embd 768 --n-head 12 --n-positions 1024 >/dev/null
python -m accelerate.commands.launch --config_file accelerate_configs/ddp.yaml --num_processes 1 --mixed_precision bf16 \
  recipes/gpt2.py --model_name_or_path "$WORK/gpt2-124m" --dataset_name pydoc --block_size 1024 \
  --per_device_train_batch_size "$MICRO" --gradient_accumulation_steps 1 --max_steps "$STEPS" --logging_steps 10 \
  --learning_rate 3e-4 --warmup_steps 0 --eval_on_start false --save_final_model false --report_to none \
  --output_dir "$WORK/run" --overwrite_output_dir true
python - "$WORK" "$MICRO" <<'PY'
import json, subprocess, sys
work, micro = sys.argv[1], sys.argv[2]
s = json.load(open(f"{work}/run/summary.json"))
rows = [json.loads(line) for line in open(f"{work}/run/metrics.jsonl") if '"loss"' in line]
last = rows[-1]  # the last logging window: training time only, after warm-up
mfu = last.get("mfu")
print(f"gpu_check: {last['tokens_per_s']:,.0f} tokens/s in the last window, MFU "
      + (f"{100 * mfu:.1f}%" if mfu is not None else "n/a (no GPU peak known)")
      + f", peak memory {max(s['peak_memory_gb_per_rank']):.2f} GB")
try:
    import torch
    memory = f"{torch.cuda.get_device_properties(0).total_memory / 1e9:.0f}GB" if torch.cuda.is_available() else "80GB"
except Exception:
    memory = "80GB"
subprocess.run([sys.executable, "-m", "toolkit", "plan", "--model", f"{work}/gpt2-124m", "--gpus", "1", "--gpu-memory",
                memory, "--micro-batch", micro, "--seq-len", "1024", "--precision", "bf16"], check=True)
PY
if python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  for CONFIG in ddp zero2; do
    python -m accelerate.commands.launch --config_file "accelerate_configs/$CONFIG.yaml" --num_processes 1 \
      --mixed_precision fp16 recipes/gpt2.py --model_name_or_path "$WORK/gpt2-124m" --dataset_name pydoc \
      --block_size 1024 --per_device_train_batch_size "$MICRO" --gradient_accumulation_steps 1 --max_steps "$STEPS" \
      --logging_steps 1 --learning_rate 3e-4 --warmup_steps 0 --eval_on_start false --save_final_model false \
      --report_to none --output_dir "$WORK/run-fp16-$CONFIG" --overwrite_output_dir true
    python - "$WORK/run-fp16-$CONFIG" "$CONFIG" <<'PY'
import json, math, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl") if '"loss"' in line]
skipped = max(row.get("skipped_steps", 0) for row in rows)
assert math.isfinite(rows[-1]["loss"]), rows[-1]
print(f"gpu_check fp16 {sys.argv[2]}: {rows[-1]['step']} steps, last loss {rows[-1]['loss']:.3f}, "
      f"{skipped} skipped for an overflow (dynamic loss scaling)")
PY
  done
fi
for PACKING in padded bfd; do
  if [ "$PACKING" = padded ]; then OPTION=(--packing false); else OPTION=(--packing_strategy bfd); fi
  python -m accelerate.commands.launch --config_file accelerate_configs/ddp.yaml --num_processes 1 --mixed_precision bf16 \
    recipes/gpt2.py --model_name_or_path "$WORK/gpt2-124m" --dataset_name pydoc --block_size 1024 "${OPTION[@]}" \
    --per_device_train_batch_size "$MICRO" --gradient_accumulation_steps 1 --max_steps "$STEPS" --logging_steps 10 \
    --learning_rate 3e-4 --warmup_steps 0 --eval_on_start false --save_final_model false \
    --report_to none --output_dir "$WORK/run-$PACKING" --overwrite_output_dir true
done
python - "$WORK" <<'PY'
import json, sys
last = {}
for mode in ("padded", "bfd"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/run-{mode}/metrics.jsonl") if '"loss"' in line]
    last[mode] = rows[-1]
    print(f"gpu_check packing {mode}: {rows[-1]['tokens_per_s']:,.0f} real tokens/s in the last window, "
          f"fill rate {rows[-1].get('fill_rate', float('nan')):.3f}")
print(f"gpu_check packing: bfd / padded real tokens/s = "
      f"{last['bfd']['tokens_per_s'] / last['padded']['tokens_per_s']:.2f}x")
PY
FLASH=""
if python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  if python -c "import flash_attn" 2>/dev/null; then FLASH=flash_attention_2
  elif python -c "import kernels" 2>/dev/null; then FLASH=kernels-community/flash-attn; fi
fi
if [ -n "$FLASH" ]; then
  python -m accelerate.commands.launch --config_file accelerate_configs/ddp.yaml --num_processes 1 --mixed_precision bf16 \
    recipes/gpt2.py --model_name_or_path "$WORK/gpt2-124m" --dataset_name pydoc --block_size 1024 \
    --packing_strategy bfd --attn_implementation "$FLASH" \
    --per_device_train_batch_size "$MICRO" --gradient_accumulation_steps 1 --max_steps "$STEPS" --logging_steps 10 \
    --learning_rate 3e-4 --warmup_steps 0 --eval_on_start false --save_final_model false \
    --report_to none --output_dir "$WORK/run-bfd-flash" --overwrite_output_dir true 2>&1 | tee "$WORK/bfd-flash.log"
  grep -q "checked that a packed document's logits do not depend on the documents" "$WORK/bfd-flash.log"
  python - "$WORK" "$FLASH" <<'PY'
import json, sys
rows = {m: [json.loads(x) for x in open(f"{sys.argv[1]}/run-{m}/metrics.jsonl") if '"loss"' in x] for m in ("bfd", "bfd-flash")}
flash, sdpa = rows["bfd-flash"][-1], rows["bfd"][-1]
print(f"gpu_check packing bfd with {sys.argv[2]}: guard passed, {flash['tokens_per_s']:,.0f} real tokens/s "
      f"({flash['tokens_per_s'] / sdpa['tokens_per_s']:.2f}x sdpa's bfd), loss {flash['loss']:.4f} against sdpa's "
      f"{sdpa['loss']:.4f}")
assert abs(rows["bfd-flash"][0]["loss"] / rows["bfd"][0]["loss"] - 1) < 0.02, (rows["bfd-flash"][0], rows["bfd"][0])
PY
else
  echo "gpu_check packing: no flash-attention here (flash-attn or kernels, and a GPU): the packed flash run is skipped"
fi
if python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  # train() in process on the GPU leaves glibc's allocator alone (cpu_memory_reuse is for CPU ranks), and on the CPU
  # gives glibc its settings back when it returns (docs/pitfalls.md#glibc-restore)
  python -m pytest -q -p no:cacheprovider tests/unit/test_host_memory.py
fi
if python -c "import sys, torch, importlib.util; sys.exit(not (torch.cuda.is_available() and importlib.util.find_spec('bitsandbytes')))"; then
  python -m toolkit offline smollm2 "$WORK/smollm2" >/dev/null
  # every visible GPU: the 4-bit base sharded across them (bf16 storage, so FSDP2 can shard it: docs/memory.md)
  GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
  python -m accelerate.commands.launch --config_file accelerate_configs/fsdp.yaml --num_processes "$GPUS" \
    recipes/gpt2.py --model_name_or_path "$WORK/smollm2" --dataset_name pydoc --block_size 1024 \
    --use_peft true --lora_r 16 --lora_target_modules all-linear --load_in_4bit true --use_bnb_nested_quant true \
    --torch_dtype bfloat16 --per_device_train_batch_size "$MICRO" --gradient_accumulation_steps 1 \
    --max_steps "$STEPS" --logging_steps 10 --learning_rate 2e-4 --warmup_steps 0 --eval_on_start false \
    --save_final_model false --report_to none --output_dir "$WORK/run-qlora" --overwrite_output_dir true
  python - "$WORK/run-qlora" <<'PY'
import json, math, sys
s = json.load(open(f"{sys.argv[1]}/summary.json"))
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl") if '"loss"' in line]
assert math.isfinite(rows[-1]["loss"]) and rows[-1]["loss"] < rows[0]["loss"], (rows[0], rows[-1])
print(f"gpu_check qlora fsdp2: loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, "
      f"{rows[-1]['tokens_per_s']:,.0f} tokens/s in the last window, peak memory {max(s['peak_memory_gb_per_rank']):.2f} GB")
PY
fi
if python -c "import sys, torch; sys.exit(torch.cuda.device_count() < 2)"; then
  SPLIT=(recipes/gpt2.py --model_name_or_path "$WORK/gpt2-124m" --dataset_name pydoc --block_size 512 --packing false
         --optim sgd --learning_rate 0.1 --max_grad_norm 0 --lr_scheduler_type constant --weight_decay 0 --max_steps 3
         --logging_steps 1 --eval_on_start false --report_to none --seed 7 --overwrite_output_dir true)
  python -m accelerate.commands.launch --config_file accelerate_configs/ddp.yaml --num_processes 1 "${SPLIT[@]}" \
    --per_device_train_batch_size 4 --output_dir "$WORK/split-one"
  for FIELD in sequence_parallel_size context_parallel_size; do
    python -m accelerate.commands.launch --config_file accelerate_configs/ddp.yaml --num_processes 2 "${SPLIT[@]}" \
      --per_device_train_batch_size 4 "--$FIELD" 2 --output_dir "$WORK/split-$FIELD"
  done
  python - "$WORK" <<'PY'
import sys
from safetensors.torch import load_file
work = sys.argv[1]
one = load_file(f"{work}/split-one/final/model.safetensors")
for field in ("sequence_parallel_size", "context_parallel_size"):
    two = load_file(f"{work}/split-{field}/final/model.safetensors")
    diff = max((one[k].double() - two[k].double()).abs().max().item() for k in one)
    print(f"gpu_check {field} 2 on 2 GPUs: final weights {diff:.2e} from one process")
    assert diff <= 1e-5, (field, diff)
PY
else
  echo "gpu_check sequence split: fewer than 2 GPUs, the Ulysses and ring equality check is skipped"
fi
if python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  # torch_compile (docs/performance.md#compiled-blocks): GPT-2 124M bf16 with and without its blocks compiled by
  # inductor, tokens/s and MFU of the last logging window (after the compile), the compile cache in $WORK
  for COMPILE in false true; do
    python -m accelerate.commands.launch --config_file accelerate_configs/ddp.yaml --num_processes 1 \
      --mixed_precision bf16 recipes/gpt2.py --model_name_or_path "$WORK/gpt2-124m" --dataset_name pydoc \
      --block_size 1024 --per_device_train_batch_size "$MICRO" --gradient_accumulation_steps 1 --max_steps "$STEPS" \
      --logging_steps 10 --learning_rate 3e-4 --warmup_steps 0 --eval_on_start false --save_final_model false \
      --report_to none --torch_compile "$COMPILE" --torch_compile_cache_dir "$WORK/compile-cache" \
      --output_dir "$WORK/run-compile-$COMPILE" --overwrite_output_dir true
  done
  python - "$WORK" <<'PY'
import json, sys
for compile_ in ("false", "true"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/run-compile-{compile_}/metrics.jsonl") if '"loss"' in line]
    mfu = rows[-1].get("mfu")
    print(f"gpu_check torch_compile {compile_}: {rows[-1]['tokens_per_s']:,.0f} tokens/s in the last window, MFU "
          + (f"{100 * mfu:.1f}%" if mfu is not None else "n/a") + f", last loss {rows[-1]['loss']:.3f}")
PY
fi
