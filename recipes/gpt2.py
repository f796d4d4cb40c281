"""Fine-tune a causal language model (GPT-2 by default) with the toolkit's loop.

The recipe builds the tokenizer, the model and the dataset (``toolkit.training.build``: the same function the quickstart
notebook uses) and hands them to the loop; everything else (sample order, accumulation, loss normalisation,
checkpoints, export) is the library's. The launch config picks the strategy; nothing here changes:

    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 recipes/gpt2.py --config recipes/configs/gpt2.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/gpt2.py --config recipes/configs/gpt2.yaml
    python recipes/gpt2.py --config recipes/configs/gpt2.yaml --learning_rate 1e-4      # one process; any field overridable
"""

from toolkit.cli.recipe import cli
from toolkit.config import parse_args


def main(callbacks=None):
    # bad fields stop here, before any process group, data or weights
    cfg = parse_args(task="causal-lm", description=__doc__)
    from toolkit.parallel.accelerator import make_accelerator  # torch and accelerate load from here on

    accelerator = make_accelerator(cfg.train)  # a launch config at odds with the recipe stops here
    # the training stack (transformers' models, datasets, peft: 2.3 s a process) loads once nothing refused the run
    from toolkit.training.build import build
    from toolkit.training.loop import train

    # seed; tokenizer; raw data (checks files and the text column); tokenize/pack on rank 0 first; then the weights
    parts = build(cfg, accelerator)
    return train(cfg, accelerator, **parts.train_kwargs(), callbacks=callbacks)


if __name__ == "__main__":
    cli(main)
