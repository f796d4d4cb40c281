"""Chat supervised fine-tuning: the loss on the assistant's turns only (``toolkit.data.chat`` builds the label mask).

Data: jsonl rows with ``messages`` (a list of {role, content}), or ``dataset_name: pydoc-chats`` (questions about
Python answered from its reference docs, built offline). One chat per row, padded per micro-batch; ``--packing true``
packs whole chats best-fit decreasing, each attending only to itself (``packing_strategy: bfd``). The
loss is normalised by the assistant tokens of the whole global batch, as for any recipe. With ``use_peft: true`` it
trains LoRA adapters. It prints one answer before and one after fine-tuning.

    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 recipes/sft.py --config recipes/configs/sft_smollm2.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/sft.py --config recipes/configs/sft_smollm2.yaml --use_peft true --output_dir outputs/sft-smollm2-lora
"""

from toolkit.cli.recipe import cli
from toolkit.config import parse_args


def main(callbacks=None):
    # bad fields stop here, before any process group, data or weights
    cfg = parse_args(task="chat-sft", description=__doc__)
    from toolkit.parallel.accelerator import make_accelerator  # torch and accelerate load from here on

    accelerator = make_accelerator(cfg.train)  # a launch config at odds with the recipe stops here
    # the training stack (transformers' models, datasets, peft: 2.3 s a process) loads once nothing refused the run
    from toolkit.models.generation import first_prompt, show_answer
    from toolkit.tasks.sft import ChatSFT
    from toolkit.training.build import build
    from toolkit.training.loop import train

    parts = build(cfg, accelerator, task=ChatSFT())  # template checked, chats tokenized with their masks, weights
    prompt = first_prompt(parts.eval_dataset or parts.train_dataset)
    show_answer(accelerator, cfg, parts.tokenizer, prompt, folder=None, when="before fine-tuning")
    summary = train(cfg, accelerator, **parts.train_kwargs(), callbacks=callbacks)
    if summary["final_model"]:
        show_answer(accelerator, cfg, parts.tokenizer, prompt, folder=summary["final_model"], when="after fine-tuning")
    return summary


if __name__ == "__main__":
    cli(main)
