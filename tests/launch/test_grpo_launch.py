"""recipes/grpo.py launched: 2 ranks x micro 2 x accumulation 2 end with the weights of 1 process x 8 completions
(SGD, 1e-6) under DDP, ZeRO-2, ZeRO-3 and FSDP2, sampling included (the same rewards at every step); with beta > 0 (a live
reference sharded like the policy) and num_iterations 2 under ZeRO-3; with LoRA (the adapter disabled as the
reference) under DDP; a resume from the 2-rank run's step-2 checkpoint ends where the straight run ends, and one
under ZeRO-3 from a step whose next step reuses a batch (num_iterations 2) too. Every
run joins the shared launch of its config and world size (helpers.Runs.plan): no launch of its own."""

from __future__ import annotations

import json
import os

import pytest
from helpers import Killed, Runs, load_weights, max_abs_diff

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def _grpo(tiny_model) -> dict:
    # rewards a random tiny model's completions earn unequally (tests/scripts/grpo_rewards.py): non-zero advantages
    return dict(model_name_or_path=tiny_model, dataset_name="arithmetic", chat_template=CHAT_TEMPLATE,
                num_generations=4, max_completion_length=6, max_prompt_length=32, max_steps=3, logging_steps=1,
                report_to="none", optim="sgd", learning_rate=0.5, max_grad_norm=0, lr_scheduler_type="constant",
                weight_decay=0, seed=7, save_steps=2, reward_funcs="grpo_rewards:vowels")


def _kl(tiny_model) -> dict:
    # a checkpoint every step: step-1's holds the batch step 1 reuses (kl_resumed starts there)
    return {**_grpo(tiny_model), "beta": 0.04, "num_iterations": 2, "loss_type": "grpo", "save_steps": 1}


def _lora(tiny_model) -> dict:
    return {**_grpo(tiny_model), "beta": 0.04, "use_peft": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
            "lora_target_modules": "c_attn"}


STRATEGIES = ("ddp", "zero2", "zero3", "fsdp")


def plan_runs(pool, tmp_path_factory, tiny_model):
    r = Runs(tmp_path_factory.mktemp("grpo"), None, {}, {}, pool=pool)
    for name, cfg in (("grpo", _grpo(tiny_model)), ("kl", _kl(tiny_model)), ("lora", _lora(tiny_model))):
        r.plan(f"{name}_one", "ddp.yaml", 1, 8, 1, cfg, recipe="grpo", probe=False)
    for strategy in STRATEGIES:
        r.plan(f"grpo_{strategy}", f"{strategy}.yaml", 2, 2, 2, _grpo(tiny_model), recipe="grpo", probe=False)
    # 4 ranks x 1 x 2: every group of 4 completions spans the 4 ranks (joins test_pipeline's 4-rank FSDP2 launch);
    # 2 steps, no checkpoint (against grpo_one's step-2 checkpoint)
    r.plan("grpo_fsdp4", "fsdp.yaml", 4, 1, 2, {**_grpo(tiny_model), "max_steps": 2, "save_steps": 100},
           recipe="grpo", probe=False)
    r.plan("kl_zero3", "zero3.yaml", 2, 2, 2, _kl(tiny_model), recipe="grpo", probe=False)
    r.plan("lora_ddp", "ddp.yaml", 2, 2, 2, _lora(tiny_model), recipe="grpo", probe=False)
    r.plan("grpo_resumed", "ddp.yaml", 2, 2, 2, {**_grpo(tiny_model), "resume_from_checkpoint": "latest"},
           copy_from=("grpo_ddp", 2), recipe="grpo", probe=False)
    r.plan("kl_resumed", "zero3.yaml", 2, 2, 2, {**_kl(tiny_model), "resume_from_checkpoint": "latest"},
           copy_from=("kl_zero3", 1), recipe="grpo", probe=False)
    # SIGKILLed inside a save (helpers.Killed), relaunched in the DDP batch beside the uninterrupted run
    r.plan("killed", "ddp.yaml", 2, 2, 2, _killed(tiny_model), recipe="grpo", probe=False,
           interrupted=Killed(before_step=6))
    r.plan("killed_straight", "ddp.yaml", 2, 2, 2, _killed(tiny_model), recipe="grpo", probe=False)
    return {"runs": r}


def _killed(tiny_model) -> dict:
    # num_iterations 3: steps 0 and 3 generate, so a resume from step 2 (or later) trains on a batch it holds
    return {**_grpo(tiny_model), "max_steps": 6, "save_steps": 1, "save_total_limit": 2, "num_iterations": 3}


@pytest.fixture(scope="module")
def runs(run_pool):
    return run_pool.modules[(__name__, "runs")]


def _rows(run: str) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def _rewards(run: str) -> list[float]:
    return [r["reward"] for r in _rows(run) if "reward" in r]


def _final(run: str) -> dict:
    final = os.path.join(run, "final")
    if os.path.exists(os.path.join(final, "adapter_model.safetensors")):
        from safetensors.torch import load_file

        return {k: v.double() for k, v in load_file(os.path.join(final, "adapter_model.safetensors")).items()}
    return load_weights(final)


@pytest.mark.slow  # multi-rank launches: the full suite's layer
def test_four_ranks_equal_one_process_sampling_included(runs):
    """4 ranks x 1 x 2 under FSDP2 (each group of 4 completions drawn and scored on 4 ranks, its statistics
    gathered): the rewards of one process's first 2 steps, and its weights at step 2 (its checkpoint) within 1e-6."""
    one, four = runs.get_planned("grpo_one"), runs.get_planned("grpo_fsdp4")
    assert _rewards(four) == pytest.approx(_rewards(one)[:2], abs=1e-6) and len(_rewards(four)) == 2
    diff = max_abs_diff(load_weights(os.path.join(one, "checkpoints", "step-2")), _final(four))
    assert diff <= 1e-6, diff


@pytest.mark.slow  # multi-rank launches: the full suite's layer
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_equal_one_process_sampling_included(runs, strategy, tiny_model):
    """The same rewards at each step (the same completions drawn on 1 and 2 ranks, whichever rank and micro-batch a
    completion lands on), the same final weights within 1e-6; the weights moved."""
    one, two = runs.get_planned("grpo_one"), runs.get_planned(f"grpo_{strategy}")
    assert _rewards(two) == pytest.approx(_rewards(one), abs=1e-6) and len(_rewards(one)) == 3
    assert len(set(_rewards(one))) == 3  # each step drew other completions
    diff = max_abs_diff(_final(one), _final(two))
    assert diff <= 1e-6, diff
    assert max_abs_diff(_final(one), load_weights(tiny_model)) > 1e-3


@pytest.mark.slow  # multi-rank launches: the full suite's layer
@pytest.mark.parametrize("name", ["kl_zero3", "lora_ddp"])
def test_reference_and_reused_batches_equal_one_process(runs, name):
    """beta > 0 and num_iterations 2 under ZeRO-3 (the live reference sharded like the policy; the second step of
    each batch against the old log-probs): kl logged, the same rewards, 1e-6 apart. LoRA with beta > 0 under DDP (the
    adapter disabled as the reference): the adapters 1e-6 apart."""
    one, two = runs.get_planned(f"{name.split('_')[0]}_one"), runs.get_planned(name)
    assert _rewards(two) == pytest.approx(_rewards(one), abs=1e-6)
    kls = [r["kl"] for r in _rows(two) if "kl" in r]
    assert kls and kls[-1] > 0
    diff = max_abs_diff(_final(one), _final(two))
    assert diff <= 1e-6, diff


@pytest.mark.slow  # multi-rank launches: the full suite's layer
def test_resume_equals_the_straight_run(runs):
    """Resumed from the 2-rank run's step-2 checkpoint: step 3 draws the same completions (the sampling state is
    (seed, step, prompt, generation index), in no checkpoint) and ends with the same weights."""
    straight, resumed = runs.get_planned("grpo_ddp"), runs.get_planned("grpo_resumed")
    assert _rewards(resumed)[-1] == _rewards(straight)[-1]
    assert max_abs_diff(_final(straight), _final(resumed)) == 0.0


@pytest.mark.slow  # multi-rank launches: the full suite's layer
def test_a_resume_at_a_reused_batch_is_bit_identical_under_zero3(runs):
    """num_iterations 2 under ZeRO-3 with the live reference: resumed from step-1's checkpoint, whose next step trains
    again on step 0's completions (held in the checkpoint, every rank's rows gathered), the run ends bit-identical to
    the straight one, with the same rewards and the summary's reward_start the run's first (before: refused)."""
    straight, resumed = runs.get_planned("kl_zero3"), runs.get_planned("kl_resumed")
    assert len(_rewards(straight)) == 2 and _rewards(resumed) == _rewards(straight)[1:]  # generated at steps 0, 2
    assert max_abs_diff(_final(straight), _final(resumed)) == 0.0
    summary = [json.load(open(os.path.join(run, "summary.json"))) for run in (straight, resumed)]
    assert summary[1]["reward_start"] == summary[0]["reward_start"] and summary[1]["steps"] == 3


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(runs):
    """SIGKILL to the whole 2-rank job while a checkpoint save is under way (test_reliability's), relaunched from
    ``latest``: the completions drawn after the resume are those of the uninterrupted run (the sampling state is the
    seed, the step and the prompt: nothing to save) and the weights end bit-identical. num_iterations 3 (steps 0 and 3
    generate): the kill lands in the save after step 3 at the earliest, so ``latest`` is step 2 (or later), whose
    next step trains on step 0's batch, held in that checkpoint."""
    from helpers import saving_checkpoints, steps_logged

    out, straight = runs.get_planned("killed"), runs.get_planned("killed_straight")
    killed = runs.interrupted["killed"]
    assert killed.left and not saving_checkpoints(out) and steps_logged(out) == list(range(1, 7))
    assert _rewards(out)[-1] == _rewards(straight)[-1]
    diff = max_abs_diff(_final(out), _final(straight))
    print(f"grpo: killed after step {killed.at}, resumed: max|dw| = {diff:.1e}")
    assert diff == 0.0
