"""CPU ranks keep freed memory for reuse (toolkit/host_memory.py): when it is on. The effect itself (process-wide and
irreversible) is measured in fresh interpreters: tests/launch/test_host_memory_launch.py."""


def test_memory_reuse_is_on_by_default_unless_a_memory_switch_asks_for_less_memory():
    from transformers import GPT2Config, GPT2LMHeadModel

    from toolkit.config import TrainingArguments
    from toolkit.loop import _reuse_cpu_memory
    from toolkit.model import enable_activation_checkpointing

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    assert _reuse_cpu_memory(TrainingArguments(), model)
    assert not _reuse_cpu_memory(TrainingArguments(loss_chunk_size=256), model)
    assert not _reuse_cpu_memory(TrainingArguments(cpu_memory_reuse=False), model)
    enable_activation_checkpointing(model)  # also how FSDP's launch-config checkpointing ends up
    assert not _reuse_cpu_memory(TrainingArguments(), model)
    assert _reuse_cpu_memory(TrainingArguments(cpu_memory_reuse=True, loss_chunk_size=256), model)
