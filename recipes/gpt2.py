"""Fine-tune a causal language model (GPT-2 by default) with the toolkit's loop.

The recipe only builds the tokenizer, the model and the dataset; everything else (order, accumulation, loss
normalisation, checkpoints, export) is the library's. The launch config picks the strategy; nothing here changes:

    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 recipes/gpt2.py --config recipes/configs/gpt2.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 2 recipes/gpt2.py --config recipes/configs/gpt2.yaml
    python recipes/gpt2.py --config recipes/configs/gpt2.yaml --learning_rate 1e-4      # one process; any field overridable
"""

from accelerate.utils import set_seed

from toolkit import data
from toolkit.config import cli, parse_args
from toolkit.distributed import make_accelerator
from toolkit.loop import train
from toolkit.model import load_config, load_model, load_tokenizer, max_positions


def main(callbacks=None):
    cfg = parse_args()  # bad fields stop here, before any process group, data or weights
    accelerator = make_accelerator(cfg.train)
    set_seed(cfg.train.seed)

    tokenizer = load_tokenizer(cfg.model, log=accelerator.print)
    model_config = load_config(cfg.model)
    raw = data.load_raw_datasets(cfg.data)  # checks files and the text column before the weights load
    block_size = data.resolve_block_size(cfg.data, tokenizer, max_positions(model_config))
    with accelerator.main_process_first():  # rank 0 tokenizes and fills the cache, the others read it
        lm = data.tokenize_and_group(raw, tokenizer, cfg.data, block_size)

    model = load_model(cfg.model, model_config)
    train(cfg, accelerator, model, tokenizer, lm["train"], lm.get("validation"),
          collator=data.CausalLMCollator(tokenizer.pad_token_id), callbacks=callbacks)


if __name__ == "__main__":
    cli(main)
