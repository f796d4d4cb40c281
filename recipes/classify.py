"""Sequence classification: a pretrained encoder (or any model with a ForSequenceClassification head) on labelled
text; accuracy and macro-F1 on the validation split, gathered across ranks without duplicates.

Data: a text column and a label column (class names or ids), from local files or the Hub, or ``dataset_name:
stdlib-docstrings`` (docstrings of standard-library modules labelled by their module, built offline). Optional
``class_weights`` (one per class, or ``balanced``). With ``use_peft: true`` it trains LoRA adapters and the head.

    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 recipes/classify.py --config recipes/configs/classify_minilm.yaml
    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 recipes/classify.py --config recipes/configs/classify_minilm.yaml --use_peft true --output_dir outputs/classify-minilm-lora
"""

from toolkit.cli.recipe import cli
from toolkit.config import parse_args


def main(callbacks=None):
    # bad fields stop here, before any process group, data or weights
    cfg = parse_args(task="sequence-classification", description=__doc__)
    from toolkit.parallel.accelerator import make_accelerator  # torch and accelerate load from here on

    accelerator = make_accelerator(cfg.train)  # a launch config at odds with the recipe stops here
    # the training stack (transformers' models, datasets, peft: 2.3 s a process) loads once nothing refused the run
    from toolkit.tasks.classification import SequenceClassification
    from toolkit.training.build import build
    from toolkit.training.loop import train

    parts = build(cfg, accelerator, task=SequenceClassification())  # labels read before the head is sized
    return train(cfg, accelerator, **parts.train_kwargs(), callbacks=callbacks)


if __name__ == "__main__":
    cli(main)
