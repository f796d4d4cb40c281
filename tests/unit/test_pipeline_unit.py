"""Pipeline parallelism without a process group: the cut, the stages chained by hand against the whole model, and the
refusals of the config. The launched runs (2 gloo ranks against one process) are in tests/launch/test_pipeline.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM


def _chained(model, bounds, ids, mask):
    from toolkit.parallel.pipeline import Stage, family

    h = ids
    for s, layers in enumerate(bounds):
        h = Stage(model, family(model), layers, s == 0, s == len(bounds) - 1)(h, mask)
    return h


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_llama"])
def test_stages_chained_give_the_whole_models_logits_on_padded_rows(fixture, request):
    """GPT-2 (tied head, learned positions, dropout) and Llama (rotary): each stage builds the causal mask from the
    padded rows' attention mask as the model does; the real tokens' logits equal the whole model's."""
    from toolkit.parallel.pipeline import cut

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture)).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:], mask[2, 3:] = 0, 0  # right padding, as the collator pads
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask).logits
        staged = _chained(model, cut(model, 2), ids, mask)
    real = mask.bool()
    assert staged.shape == whole.shape
    assert (staged[real] - whole[real]).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_stages_keep_a_sliding_window_as_the_whole_model_does(kind):
    """Mistral's sliding window (every layer) and Qwen2's sliding layers (``layer_types``): each stage builds the mask
    each of its layers takes, so rows longer than the window give the whole model's logits; 3 layers cut into 2
    stages and into 3 (a count the stages do not divide, and one layer each)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from toolkit.parallel.pipeline import cut

    small = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=50,
                 num_hidden_layers=3, sliding_window=4)
    torch.manual_seed(0)
    model = (MistralForCausalLM(MistralConfig(**small)) if kind == "mistral" else
             Qwen2ForCausalLM(Qwen2Config(**small, use_sliding_window=True, max_window_layers=1))).eval()
    ids = torch.randint(0, 50, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    real = mask.bool()
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask).logits
        for stages in (2, 3):
            assert (_chained(model, cut(model, stages), ids, mask)[real] - whole[real]).abs().max() < 1e-5


def test_cut_balances_whole_layers_by_parameters(tiny_llama):
    """Whole layers, every stage at least one, the embedding counted on the first stage and the head on the last;
    more stages than layers is refused naming the field."""
    from toolkit.errors import ConfigError
    from toolkit.parallel.pipeline import cut

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert cut(model, 2) == [range(0, 1), range(1, 2)]
    with pytest.raises(ConfigError) as e:
        cut(model, 3)
    assert e.value.field_name == "pipeline_parallel_size" and "the model has 2" in str(e.value)
    # 8 equal layers behind a large embedding: the first stage takes fewer layers than the last
    layers = torch.nn.ModuleList([torch.nn.Linear(10, 10) for _ in range(8)])
    model.model.layers = layers
    bounds = cut(model, 2)
    assert sum(len(b) for b in bounds) == 8 and bounds[0].start == 0 and bounds[-1].stop == 8
    assert all(len(b) >= 1 for b in bounds)


def test_other_architectures_are_refused_naming_what_is_supported():
    from transformers import BertConfig, BertForMaskedLM

    from toolkit.errors import ConfigError
    from toolkit.parallel.pipeline import family

    model = BertForMaskedLM(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=8, vocab_size=32))
    with pytest.raises(ConfigError) as e:
        family(model)
    assert "Llama" in str(e.value) and "GPT-2" in str(e.value) and "'bert'" in str(e.value)


@pytest.mark.parametrize("fields, field", [
    ({"pipeline_schedule": "zb"}, "pipeline_schedule"),
    ({"pipeline_schedule": "interleaved_1f1b"}, "pipeline_stages_per_rank"),
    ({"pipeline_stages_per_rank": 2}, "pipeline_stages_per_rank"),
    ({"loss_chunk_size": 16}, "loss_chunk_size"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
    ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps"),  # 1F1B: at least one per stage
    ({"pipeline_parallel_size": 4, "gradient_accumulation_steps": 6, "pipeline_schedule": "interleaved_1f1b",
      "pipeline_stages_per_rank": 2}, "gradient_accumulation_steps"),
])
def test_pipeline_fields_refused_before_work(tmp_path, fields, field):
    from toolkit.config import TrainingArguments
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        TrainingArguments(output_dir=str(tmp_path / "out"),
                          **{"pipeline_parallel_size": 2, "gradient_accumulation_steps": 4, **fields})
    assert e.value.field_name == field


def test_checkpoint_fields_are_taken_under_a_pipeline(tmp_path):
    """save_steps and resume_from_checkpoint work under a pipeline (toolkit.checkpointing.staged)."""
    from toolkit.config import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), pipeline_parallel_size=2, gradient_accumulation_steps=4,
                             save_steps=2, resume_from_checkpoint="latest")
    assert (args.save_steps, args.resume_from_checkpoint) == (2, "latest")


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_llama"])
def test_a_pipeline_checkpoint_numbers_the_optimizer_as_one_process_does(fixture, request):
    """optimizer.bin's numbering (``staged.plain_order``, from the whole model's names and shapes) is the order of a
    one-process run's optimizer (``build_optimizer``: its two groups), the tied weight once: a pipeline's moments
    land on the same parameters under one process or DDP, and theirs on a pipeline's."""
    from toolkit.checkpointing.staged import plain_order
    from toolkit.config import TrainingArguments
    from toolkit.training.loop import build_optimizer

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture))
    optimizer = build_optimizer(model, TrainingArguments(output_dir="unused", optim="adamw_torch", weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups] == plain_order(shapes)
    assert len(plain_order(shapes)) == 2


@pytest.mark.parametrize("wrote, strategy, plan", [
    ("pipeline", "single", None), ("pipeline", "ddp", None), ("ddp", "pipeline", None), ("single", "pipeline", None),
    ("pipeline", "pipeline", None), ("fsdp2", "pipeline", "plain")])
def test_a_pipeline_checkpoint_loads_under_one_process_and_ddp_and_theirs_under_a_pipeline(wrote, strategy, plan):
    """Any world size: the layout is one process's; FSDP2's converts to it first, as for one process."""
    from toolkit.checkpointing.resume import load_plan

    assert load_plan("ck", {"strategy": wrote, "loop": {"world_size": 2}}, strategy, 4) == plan


def test_a_zero_checkpoint_is_refused_under_a_pipeline_naming_its_launch():
    from toolkit.checkpointing.resume import load_plan
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_plan("ck", {"strategy": "deepspeed-zero3", "loop": {"world_size": 2}}, "pipeline", 2)
    assert e.value.field_name == "resume_from_checkpoint" and "zero3.yaml" in str(e.value)


@pytest.mark.parametrize("task_name, extra, field", [
    ("classify", {}, "pipeline_parallel_size"), ("dpo", {}, "pipeline_parallel_size"),
    ("gpt2", {"use_peft": True}, "use_peft"),
    # more stages (2 ranks x 2 stages each) than the tiny GPT-2's 2 decoder layers: the cut's refusal, from the config
    ("gpt2", {"pipeline_schedule": "interleaved_1f1b", "pipeline_stages_per_rank": 2}, "pipeline_parallel_size")])
def test_lora_classification_and_dpo_refused_before_the_data_and_weights_load(tiny_model, padded_data, tmp_path,
                                                                              task_name, extra, field):
    """A recipe's run under a pipeline: its task and LoRA are refused by ``build.check_inputs`` (which ``toolkit
    train`` also runs before launching), before tokenization and the weights."""
    from toolkit.config import config_from_dict
    from toolkit.errors import ConfigError
    from toolkit.tasks.classification import SequenceClassification
    from toolkit.tasks.dpo import DPO
    from toolkit.tasks.lm import CausalLM
    from toolkit.training.build import check_inputs

    task = {"classify": SequenceClassification, "dpo": DPO, "gpt2": CausalLM}[task_name]()
    cfg = config_from_dict({"model_name_or_path": tiny_model, **padded_data, "output_dir": str(tmp_path / "out"),
                            "pipeline_parallel_size": 2, "gradient_accumulation_steps": 4, **extra})
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg, task)
    assert e.value.field_name == field and "pipeline" in str(e.value)
    if "pipeline_stages_per_rank" in extra:
        assert "4 stages need at least 4 decoder layers; the model has 2" in str(e.value)


def test_lora_classification_and_dpo_refused_under_a_pipeline(tiny_model):
    """One line each, before any stage is built: what does not run under pipeline parallelism yet."""
    from toolkit.errors import ConfigError
    from toolkit.models.lora import is_peft_model
    from toolkit.parallel.pipeline import check_task
    from toolkit.tasks.classification import SequenceClassification
    from toolkit.tasks.dpo import DPO
    from toolkit.tasks.lm import CausalLM
    from toolkit.tasks.sft import ChatSFT

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    check_task(CausalLM(), model)
    check_task(ChatSFT(), model)
    for task in (SequenceClassification(), DPO()):
        with pytest.raises(ConfigError) as e:
            check_task(task, model)
        assert e.value.field_name == "pipeline_parallel_size" and task.name in str(e.value)
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"]))
    assert is_peft_model(peft_model)
    with pytest.raises(ConfigError) as e:
        check_task(CausalLM(), peft_model)
    assert e.value.field_name == "use_peft"


@pytest.mark.parametrize("env, world, message", [
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "4", "(FSDP1)"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "4", "deepspeed"),
    ({}, "3", "do not divide the 3 launched processes"),
])
def test_pipeline_launch_refused_before_the_accelerator(monkeypatch, env, world, message):
    from toolkit.config import TrainingArguments
    from toolkit.env.launcher import launched_strategy
    from toolkit.errors import ConfigError
    from toolkit.parallel.accelerator import _check_pipeline_launch

    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_PARALLELISM_CONFIG", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WORLD_SIZE", world)
    args = TrainingArguments(output_dir="unused", pipeline_parallel_size=2, gradient_accumulation_steps=2)
    with pytest.raises(ConfigError) as e:
        _check_pipeline_launch(args, launched_strategy())
    assert e.value.field_name == "pipeline_parallel_size" and message in str(e.value)


def test_fp16_under_a_pipeline_refused_before_the_launch(monkeypatch):
    """fp16's loss scaling is refused by ``check_launch`` (``toolkit train`` runs it before launching, every rank
    before its data and weights load), not by the stages' build after them; on a GPU host as on this CPU one."""
    from toolkit.config import TrainingArguments
    from toolkit.errors import ConfigError
    from toolkit.parallel.accelerator import check_launch

    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_PARALLELISM_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = TrainingArguments(output_dir="unused", pipeline_parallel_size=2, gradient_accumulation_steps=2)
    for asked in ({"mixed_precision": "fp16"}, {}):
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
        with pytest.raises(ConfigError) as e:
            check_launch(args, **asked)
        assert e.value.field_name == "mixed_precision" and "pipeline parallelism" in str(e.value)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    check_launch(args)  # bf16 runs under a pipeline (autocast around the schedule)


def test_plan_prints_each_stage_under_gpipe_and_1f1b_with_the_bubble(tiny_llama, capsys):
    """``toolkit plan --pipeline-parallel-size``: the stages' parameters are the cut's (adding up to the model's, the
    head once more where tied), GPipe keeps m micro-batches in flight and 1F1B at most P - i, so 1F1B is never
    above GPipe and equal on the last stage; the bubble is (P - 1) / (m + P - 1); the launch line names the fields."""
    from toolkit.cli.plan import count_model, main, pipeline_plan

    m = count_model(tiny_llama)
    rows = pipeline_plan(m, 2, 8, 2, 48, "fp32", False)
    assert sum(r["params"] for r in rows) == m.params
    assert all(r["states"] == 16 * r["params"] for r in rows)
    assert rows[0]["1f1b"]["expected"] < rows[0]["gpipe"]["expected"]
    for r in rows:
        assert r["states"] < r["1f1b"]["expected"] <= r["gpipe"]["expected"]
    assert main(["--model", tiny_llama, "--gpus", "4", "--gpu-memory", "1GB", "--seq-len", "48",
                 "--pipeline-parallel-size", "2", "--accumulation", "8"]) == 0
    out = capsys.readouterr().out
    assert "2 stages x 2 replicas, 8 micro-batches" in out and f"= {1 / 9:.1%} of a step" in out
    assert "--pipeline_parallel_size 2 --pipeline_schedule 1f1b --gradient_accumulation_steps 8" in out


@pytest.mark.parametrize("fields, field", [
    ({"packing": True, "packing_strategy": "bfd"}, "packing_strategy"),
    ({"packing": True, "packing_strategy": "bfd_split"}, "packing_strategy"),
    ({"streaming": True, "max_steps": 3, "packing": False}, "streaming")])
def test_padding_free_packing_and_streaming_refused_under_a_pipeline(tiny_model, padded_data, tmp_path, fields, field):
    """One line, from the config alone: a pipeline passes each row's attention mask, which padding-free rows have not."""
    from toolkit.config import config_from_dict
    from toolkit.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        config_from_dict({"model_name_or_path": tiny_model, **padded_data, "output_dir": str(tmp_path / "out"),
                          "pipeline_parallel_size": 2, "gradient_accumulation_steps": 4, **fields})
    assert e.value.field_name == field and "pipeline parallelism" in str(e.value)


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone (torch's pipeline stages need one), gone after the test."""
    import torch.distributed as dist
    from helpers import free_port

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "pp"))
    finally:
        dist.destroy_process_group()


def test_the_stages_hold_one_row_length_at_a_time(one_rank_group, tiny_llama):
    """Each row length a step is padded to sets the stages up anew (torch infers the shapes sent between stages once
    per stage object, and each keeps its micro-batches' receive buffers): only the current length's stages are held,
    or padded rows of many lengths pile up one set of activation buffers per length seen. Two stages on one rank
    (interleaved), steps of three lengths: each step's loss is still the whole model's."""
    from toolkit.loss import token_losses
    from toolkit.parallel.pipeline import PipelineModel

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    whole = AutoModelForCausalLM.from_pretrained(tiny_llama)
    staged = PipelineModel(model, one_rank_group, "interleaved_1f1b", 2, 2)
    torch.manual_seed(0)
    for length in (7, 12, 9):
        ids = torch.randint(0, model.config.vocab_size, (4, length))
        mask = torch.ones_like(ids)
        mask[1, length - 3:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        micro = [{"input_ids": ids[i:i + 2], "attention_mask": mask[i:i + 2], "labels": labels[i:i + 2]}
                 for i in (0, 2)]
        loss = staged.forward_backward(micro, (labels[:, 1:] != -100).sum())
        with torch.no_grad():
            expected = token_losses(whole(input_ids=ids, attention_mask=mask).logits, labels)[0].sum()
        assert abs(float(loss) - float(expected)) <= 1e-5 * float(expected)
        assert list(staged._schedules) == [length]


@pytest.mark.parametrize("rows, replicas", [(13, 2), (9, 4), (1, 2), (1, 4), (3, 4), (16, 2)])
def test_each_replica_evaluates_its_share_and_a_share_can_be_empty(rows, replicas):
    """A pipeline's replicas split the validation rows into consecutive shares that differ by one row at most, every
    row once. Fewer rows than replicas leaves shares empty, and ``Dataset.select`` takes them (a share of
    ceil(rows / replicas) started past the end for the last replicas: 9 rows over 4, 1 over 2; an IndexError after the
    weights loaded). The launched runs: tests/launch/test_pipeline.py (1 and 13 rows over 2 replicas)."""
    from datasets import Dataset

    from toolkit.parallel.pipeline import replica_rows

    data = Dataset.from_dict({"row": list(range(rows))})
    shares = [data.select(replica_rows(rows, replicas, i))["row"] for i in range(replicas)]
    assert [r for share in shares for r in share] == list(range(rows))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
