"""Group relative policy optimisation (GRPO, TRL's GRPOTrainer): sample a group of completions per prompt, score them
with reward functions, and raise the log-probabilities of the completions that scored above their group's mean
(``toolkit.tasks.grpo.task``).

Data: TRL's prompt-only format, a ``prompt`` column as text or as messages (rendered with the chat template); every
other column is passed to the reward functions by name. ``dataset_name: arithmetic`` is a built-in offline set
(questions "What is a + b?" with their answer, rewarded for the right number and for a number alone). Reward
functions are import paths (``reward_funcs: [my_module:my_reward]``, TRL's signature) with ``reward_weights``. The
global batch counts completions (prompts x num_generations); the completions of a prompt depend only on the seed, the
step and the prompt, never on the world size or the rank. Logged as TRL logs it: reward, reward_std,
rewards/<name>/mean, completions/mean_length, completions/clipped_ratio, entropy, kl, frac_reward_zero_std.

    python -m toolkit offline smollm2 outputs/models/smollm2
    python recipes/grpo.py --config recipes/configs/grpo_smollm2.yaml
    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 recipes/grpo.py --config recipes/configs/grpo_tiny.yaml
"""

from toolkit.cli.recipe import cli
from toolkit.config import parse_args


def main(callbacks=None):
    cfg = parse_args(task="grpo", description=__doc__)
    from toolkit.parallel.accelerator import make_accelerator  # torch and accelerate load from here on
    from toolkit.tasks.grpo.task import GRPO

    task = GRPO()
    task.check(cfg)  # loss_type, reward functions imported, what GRPO refuses: before any process group
    accelerator = make_accelerator(cfg.train)
    from toolkit.training.build import build
    from toolkit.training.loop import train

    parts = build(cfg, accelerator, task=task)
    return train(cfg, accelerator, **parts.train_kwargs(), callbacks=callbacks)


if __name__ == "__main__":
    cli(main)
