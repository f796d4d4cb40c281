"""GRPO step time split into generation and training: toolkit's recipes/grpo.py vs TRL's GRPOTrainer, same job.

    python bench/grpo.py [--steps 4 --model outputs/models/tiny-gpt2 --micro 8 --generations 4 --completion 16]

The same job for both, one process on the CPU: the model folder (default the tiny GPT-2 of ``python -m toolkit offline
tiny-gpt2``), the built-in arithmetic prompts rendered with one chat template, ``--micro`` completions per step
(``--micro / --generations`` prompts), at most ``--completion`` new tokens each (temperature 1), the built-in rewards
(arithmetic_correct, arithmetic_format), AdamW at lr 1e-5, beta 0, loss_type dapo, no accumulation. Each system runs in
a fresh process (``--system``); the first step is a warm-up, the next ``--steps`` are timed.

Reported per system: seconds per step, of which generation (toolkit: its ``time/generation_s``; TRL: its
``_generate`` timed from outside) and the rest (training: the loss, backward and optimizer step), completion tokens
generated per second of generation, and optimizer steps per second. The two sample differently (TRL draws with one
generator for the batch, the toolkit row by row), so the completions, and their lengths, differ: tokens/s is the fair
comparison of generation. Writes ``bench/results/grpo.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"


def _toolkit(opts, out: str) -> dict:
    sys.path.insert(0, ROOT)
    from toolkit.config import config_from_dict
    from toolkit.parallel.accelerator import make_accelerator
    from toolkit.tasks.grpo.task import GRPO
    from toolkit.training.build import build
    from toolkit.training.loop import train

    cfg = config_from_dict({"model_name_or_path": opts.model, "dataset_name": "arithmetic", "chat_template": TEMPLATE,
                            "num_generations": opts.generations, "max_completion_length": opts.completion,
                            "per_device_train_batch_size": opts.micro, "max_steps": opts.steps + 1,
                            "learning_rate": 1e-5, "logging_steps": 1, "report_to": "none", "plot": False,
                            "save_final_model": False, "output_dir": out, "seed": 0})
    task = GRPO()
    task.check(cfg)
    accelerator = make_accelerator(cfg.train)
    parts = build(cfg, accelerator, task=task)
    train(cfg, accelerator, **parts.train_kwargs())
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]  # step 1: the warm-up
    rows = [r for r in rows if "reward" in r]
    gen = sum(r["time/generation_s"] for r in rows)
    step = sum(r["time/generation_s"] + r["time/training_s"] for r in rows)
    tokens = sum(r["completions/mean_length"] * opts.micro for r in rows)
    return {"steps": len(rows), "step_s": step / len(rows), "generation_s": gen / len(rows),
            "training_s": (step - gen) / len(rows), "tokens_per_s": tokens / gen, "steps_per_s": len(rows) / step}


def _trl(opts, out: str) -> dict:
    sys.path.insert(0, ROOT)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from toolkit.tasks.grpo.rewards import arithmetic_correct, arithmetic_dataset, arithmetic_format

    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    tokenizer.chat_template = TEMPLATE
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    args = GRPOConfig(output_dir=out, use_cpu=True, bf16=False, per_device_train_batch_size=opts.micro,
                      num_generations=opts.generations, max_completion_length=opts.completion,
                      max_steps=opts.steps + 1, learning_rate=1e-5, logging_steps=1, report_to="none", beta=0.0,
                      loss_type="dapo", save_strategy="no", seed=0)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(opts.model), processing_class=tokenizer,
                          reward_funcs=[arithmetic_correct, arithmetic_format], args=args,
                          train_dataset=arithmetic_dataset()["train"])
    timings = {"generation": [], "step": [], "tokens": []}
    generate = trainer._generate

    def timed_generate(prompts):
        started = time.perf_counter()
        result = generate(prompts)
        timings["generation"].append(time.perf_counter() - started)
        timings["tokens"].append(sum(len(ids) for ids in result[1]))  # (prompt_ids, completion_ids, ...)
        return result

    trainer._generate = timed_generate

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.started = time.perf_counter()

        def on_step_end(self, *a, **k):
            timings["step"].append(time.perf_counter() - self.started)

    trainer.add_callback(StepTimer())
    trainer.train()
    gen, step, tokens = (timings[k][1:] for k in ("generation", "step", "tokens"))
    return {"steps": len(step), "step_s": sum(step) / len(step), "generation_s": sum(gen) / len(gen),
            "training_s": (sum(step) - sum(gen)) / len(step), "tokens_per_s": sum(tokens) / sum(gen),
            "steps_per_s": len(step) / sum(step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", default=os.path.join(ROOT, "outputs", "models", "tiny-gpt2"))
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--completion", type=int, default=16)
    parser.add_argument("--system", choices=("toolkit", "trl"))
    opts = parser.parse_args()
    if opts.system:
        with tempfile.TemporaryDirectory() as out:
            result = (_toolkit if opts.system == "toolkit" else _trl)(opts, out)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = {}
    for system in ("toolkit", "trl"):
        cmd = [sys.executable, __file__, "--system", system] + [f"--{k}={v}" for k, v in vars(opts).items()
                                                                 if k != "system"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"{system} failed:\n{proc.stderr[-3000:]}")
        results[system] = json.loads(line[-1][len("RESULT "):])
    write(opts, results)


def write(opts, results: dict) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    job = {k: v for k, v in vars(opts).items() if k != "system"}
    with open(os.path.join(RESULTS, "grpo.json"), "w") as f:
        json.dump({"job": job, "results": results}, f, indent=1)
    lines = [f"GRPO step, one CPU process: {os.path.basename(opts.model)}, {opts.micro} completions a step "
             f"({opts.micro // opts.generations} prompts x {opts.generations}), at most {opts.completion} new tokens, "
             f"{opts.steps} timed steps after one warm-up.", "",
             "| system | s/step | generation s | training s | tokens generated/s | steps/s |", "| --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['step_s']:.3f} | {r['generation_s']:.3f} | {r['training_s']:.3f} | "
                     f"{r['tokens_per_s']:.1f} | {r['steps_per_s']:.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, "grpo.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
