"""torch_compile: each decoder block compiled in place (toolkit.models.loading.compile_blocks). aot_eager traces the
blocks through dynamo and AOTAutograd without generating code, so a compiled run must equal the eager one bit for
bit: a cheap check that compiling changes no semantics (inductor's generated kernels round differently)."""

import os

import pytest


@pytest.mark.slow  # compiles (aot_eager) the blocks of a model: about 4 s
def test_aot_eager_blocks_train_bitwise_like_eager_with_bounded_graphs(tiny_model, padded_data, tmp_path, capsys):
    """One process, 3 SGD steps over padded micro-batches of varied lengths: the final weights of the compiled run
    are the eager run's exactly, its checkpoint keeps the eager names (no ``_orig_mod.``), and the graphs compiled
    stay bounded (one graph with dynamic batch and sequence dimensions that every length reuses, instead of one per
    length)."""
    from helpers import load_weights, max_abs_diff, train_in_process

    values = {"model_name_or_path": tiny_model, **padded_data, "block_size": 64, "packing": False,
              "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 3, "optim": "sgd",
              "learning_rate": 0.5, "max_grad_norm": 0, "lr_scheduler_type": "constant", "report_to": "none",
              "eval_steps": 100, "plot": False}
    train_in_process({**values, "output_dir": str(tmp_path / "eager")})
    capsys.readouterr()
    train_in_process({**values, "output_dir": str(tmp_path / "compiled"), "torch_compile": True,
                      "torch_compile_backend": "aot_eager"})
    out = capsys.readouterr().out
    eager, compiled = (load_weights(str(tmp_path / run / "final")) for run in ("eager", "compiled"))
    assert eager.keys() == compiled.keys() and max_abs_diff(eager, compiled) == 0.0
    assert "torch_compile: 2 decoder blocks compiled (backend aot_eager" in out
    graphs = int(out.split("torch_compile: ")[-1].split(" graphs compiled")[0])
    lengths = 12  # micro-batches of 12 padded lengths or so in 3 steps x 2 x 2: far fewer graphs than lengths
    # one graph for every length of the training steps, one for the evaluation's (no grad); issue 50: a static graph
    # for the first length came on top (3) before compile_blocks marked the shapes dynamic from the first call
    assert 1 <= graphs <= 2 < lengths, out[-2000:]
    assert os.path.isdir(tmp_path / "compiled" / "final")


def test_the_log_line_counts_inductors_cache_hits_and_misses():
    """What a compiled run's ``torch_compile:`` line says: the graphs dynamo compiled, and inductor's cache hits and
    misses once it looked (the counters the launched inductor restart reads on each rank: tests/launch/
    test_strategies.py)."""
    from torch._dynamo.utils import counters

    from toolkit.models.loading import compiled_graphs

    saved = {group: dict(values) for group, values in counters.items()}
    try:
        counters.clear()
        counters["stats"]["unique_graphs"] += 2
        assert compiled_graphs() == "2 graphs compiled in this process"
        counters["inductor"]["fxgraph_cache_hit"] += 3
        assert compiled_graphs() == "2 graphs compiled in this process (inductor's cache: 3 hits, 0 misses)"
        counters["inductor"]["fxgraph_cache_miss"] += 1
        assert compiled_graphs().endswith("(inductor's cache: 3 hits, 1 misses)")
    finally:
        counters.clear()
        for group, values in saved.items():
            counters[group].update(values)


def test_torch_compile_outside_one_process_ddp_and_fsdp2_is_refused(monkeypatch, tmp_path):
    """ZeRO, FSDP1, TP and pipelines are not proven with compiled blocks: one line, before accelerate or a model
    (FSDP1 here; ZeRO-2: the capability matrix's refused cell lm-zero2-...-aot_eager, tests/matrix)."""
    from toolkit.config import TrainingArguments
    from toolkit.errors import ConfigError
    from toolkit.parallel.accelerator import check_launch

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="torch_compile: runs on one process, under DDP and FSDP2 only, not fsdp1"):
        check_launch(TrainingArguments(output_dir=str(tmp_path), torch_compile=True))


def test_torch_compile_with_fsdp_activation_checkpointing_is_refused(monkeypatch, tmp_path):
    """FSDP2 compiles its blocks (tests/launch/test_strategies.py), but not with the launch config's activation
    checkpointing around them (transformers' checkpointing of a compiled layer is not proven): one line."""
    from toolkit.config import TrainingArguments
    from toolkit.errors import ConfigError
    from toolkit.parallel.accelerator import check_launch

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    check_launch(TrainingArguments(output_dir=str(tmp_path), torch_compile=True))  # FSDP2 itself: proven
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    with pytest.raises(ConfigError, match="torch_compile: with the launch config's fsdp_activation_checkpointing"):
        check_launch(TrainingArguments(output_dir=str(tmp_path), torch_compile=True))


@pytest.mark.slow  # two GRPO runs of 3 steps, one compiled (aot_eager): 5 s, 15 s on a loaded machine
def test_grpo_samples_eagerly_so_its_graphs_are_the_training_steps(tiny_model, tmp_path, capsys, monkeypatch):
    """GRPO's sampling (model.generate: a KV cache one token longer at each step, one-token inputs, no grad) ran
    through the compiled blocks and compiled a graph per decoding shape (7 graphs in these 3 steps; a few more steps
    reach dynamo's recompile limit, 8). Sampling runs eagerly (toolkit.tasks.grpo.sampling.sample), so the graphs are the training forward and
    backward's, bounded as an LM's are; the final weights are the eager run's exactly."""
    import sys

    import torch
    from helpers import ROOT, load_weights, max_abs_diff, train_in_process

    from toolkit.tasks.grpo.task import GRPO

    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, "tests", "scripts"), *sys.path])
    values = {"model_name_or_path": tiny_model, "dataset_name": "arithmetic", "num_generations": 4,
              "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}", "max_completion_length": 6,
              "per_device_train_batch_size": 4, "max_steps": 3, "report_to": "none", "learning_rate": 1e-2,
              "plot": False, "reward_funcs": ["grpo_rewards:vowels"]}
    train_in_process({**values, "output_dir": str(tmp_path / "eager")}, task=GRPO())
    torch._dynamo.reset()  # the count below is this process's: only this run's graphs
    torch._dynamo.utils.counters.clear()
    capsys.readouterr()
    train_in_process({**values, "output_dir": str(tmp_path / "compiled"), "torch_compile": True,
                      "torch_compile_backend": "aot_eager"}, task=GRPO())
    out = capsys.readouterr().out
    graphs = int(out.split("torch_compile: ")[-1].split(" graphs compiled")[0])
    assert 1 <= graphs <= 4, out[-2000:]  # before: 7 here (a graph per decoding shape)
    eager, compiled = (load_weights(str(tmp_path / run / "final")) for run in ("eager", "compiled"))
    assert max_abs_diff(eager, load_weights(tiny_model)) > 0 and max_abs_diff(eager, compiled) == 0.0
