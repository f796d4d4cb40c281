"""Direct preference optimisation (DPO): prefer the chosen completion of each pair to the rejected one, relative to
the starting weights (``toolkit.tasks.dpo``).

Data: TRL's preference format, ``prompt`` / ``chosen`` / ``rejected`` as text or as lists of messages (local
jsonl/parquet or the Hub), or ``dataset_name: pydoc-preferences`` (questions about Python, the section's answer chosen
and another topic's answer rejected, built offline). The loss is the mean over every pair of the global batch,
whatever the split over ranks and micro-steps; the reference is a frozen copy of the starting weights sharded like the
policy (with LoRA: the adapter disabled), or its log-probabilities computed once before training
(precompute_ref_log_probs: true). Held-out pairs give TRL's evaluation metrics (eval_rewards/accuracies,
eval_rewards/margins, ...).

    python -m toolkit offline tiny-gpt2 outputs/models/tiny-gpt2
    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 recipes/dpo.py --config recipes/configs/dpo_tiny.yaml
"""

from toolkit.cli.recipe import cli
from toolkit.config import parse_args


def main(callbacks=None):
    # bad fields (beta <= 0 too) stop here, before any process group, data or weights
    cfg = parse_args(task="dpo", description=__doc__)
    from toolkit.parallel.accelerator import make_accelerator  # torch and accelerate load from here on
    from toolkit.tasks.dpo import DPO

    task = DPO()
    task.check(cfg)  # and a reference the launch cannot give (FSDP1 without precompute_ref_log_probs)
    accelerator = make_accelerator(cfg.train)  # a launch config at odds with the recipe stops here
    # the training stack (transformers' models, datasets, peft: 2.3 s a process) loads once nothing refused the run
    from toolkit.training.build import build
    from toolkit.training.loop import train

    parts = build(cfg, accelerator, task=task)  # columns checked before the weights load; pairs tokenized
    task.add_reference(cfg, accelerator, parts)  # precomputed: the starting weights' log-probs, carried in the rows
    return train(cfg, accelerator, **parts.train_kwargs(), callbacks=callbacks)


if __name__ == "__main__":
    cli(main)
