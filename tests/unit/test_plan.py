"""``python -m toolkit plan``: the arithmetic on a 7B Llama config (meta device, no weights), and the command.

The command itself: tests/launch/test_plan_launch.py. The per-rank bytes measured on real 2-rank runs are compared in
tests/launch/test_strategies.py (``test_plan_predicts_the_model_states_each_rank_holds``)."""

import pytest

from toolkit.plan import activation_bytes, count_model, model_states_per_device, plan


@pytest.fixture(scope="module")
def llama7b(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama7b")
    LlamaConfig().save_pretrained(folder)  # the defaults are Llama-2-7B's shape
    return str(folder)


def test_mixed_precision_adamw_is_16_bytes_per_parameter(llama7b):
    """The seed's arithmetic: ~108 GB of model states under DDP, an eighth of that per GPU under ZeRO-3 on 8."""
    m = count_model(llama7b)
    assert m.params == 6_738_415_616 and (m.layers, m.width, m.heads, m.vocab) == (32, 4096, 32, 32000)
    ddp = sum(model_states_per_device(m, "DDP", 8, 8, "bf16").values())
    zero3 = sum(model_states_per_device(m, "ZeRO-3", 8, 8, "bf16").values())
    assert ddp == 16 * m.params == pytest.approx(107.8e9, rel=1e-3)
    assert zero3 == ddp / 8
    zero2 = model_states_per_device(m, "ZeRO-2", 8, 8, "bf16")
    assert (zero2["weights"], zero2["gradients"], zero2["optimizer"]) == (2 * m.params, 2 * m.params / 8,
                                                                         12 * m.params / 8)
    offload = model_states_per_device(m, "ZeRO-3 + offload", 8, 8, "bf16")
    assert offload["optimizer"] == 0 and offload["cpu"] == 12 * m.params / 8
    # fp32 under ZeRO-2 keeps a master copy as well: 20 bytes; ZeRO-3's shares the weights' partition, and torch's
    # DDP has none: 16
    assert sum(model_states_per_device(m, "ZeRO-2", 1, 1, "fp32").values()) == 20 * m.params
    assert sum(model_states_per_device(m, "ZeRO-3", 1, 1, "fp32").values()) == 16 * m.params
    assert sum(model_states_per_device(m, "DDP", 1, 1, "fp32").values()) == 16 * m.params


def test_lora_and_checkpointing_shrink_what_they_should(llama7b):
    m = count_model(llama7b, lora_r=16)
    # r x (in + out) over q, k, v, o (4096 x 4096) and gate, up (4096 -> 11008), down (11008 -> 4096), 32 layers
    assert m.trainable == 32 * 16 * (4 * 8192 + 3 * (4096 + 11008))
    states = model_states_per_device(m, "DDP", 8, 8, "bf16")
    assert states["weights"] == 4 * m.params and states["optimizer"] == 8 * m.trainable
    full = activation_bytes(m, 4, 2048, "bf16", checkpointing=False)
    recompute = activation_bytes(m, 4, 2048, "bf16", checkpointing=True)
    assert full["low"] < full["expected"] < full["high"] and recompute["expected"] < full["expected"] / 5
    rows = {r["strategy"]: r for r in plan(m, 8, 80e9, nodes=2, checkpointing=True)}
    assert rows["HSDP"]["model_states"] > rows["ZeRO-3"]["model_states"] and rows["DDP"]["fits"] == "yes"
    assert "--parallelism_config_dp_replicate_size 2 --parallelism_config_dp_shard_size 8" in rows["HSDP"]["config"]
    # TP runs within one node, without data parallelism (tp.yaml): shown, never proposed across nodes
    assert rows["TP"]["config"] is None and rows["TP"]["fits"] == rows["TP"]["fits_other"] == "n/a"
    # both activation figures, the one asked for first
    assert rows["DDP"]["activations"] == recompute and rows["DDP"]["activations_other"] == full
    one_node = {r["strategy"]: r for r in plan(m, 8, 80e9, nodes=1)}
    assert one_node["TP"]["model_states"] == one_node["FSDP2"]["model_states"] == one_node["HSDP"]["model_states"]
    assert one_node["TP"]["activations"]["expected"] < one_node["FSDP2"]["activations"]["expected"] / 2
    assert one_node["TP"]["config"].endswith("tp.yaml --parallelism_config_tp_size 8 --num_processes 8")


def test_a_classifier_is_counted_as_a_classifier(tmp_path):
    """The config's own architecture is built (a BERT classifier, not BertLMHeadModel): its logits are num_labels
    wide, not vocab wide."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=6, architectures=["BertForSequenceClassification"])
    config.save_pretrained(tmp_path)
    m = count_model(str(tmp_path))
    assert m.params == sum(p.numel() for p in BertForSequenceClassification(config).parameters())
    assert m.vocab == 6
