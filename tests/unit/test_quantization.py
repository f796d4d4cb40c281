"""A frozen base in 4 bits (QLoRA) or 8 bits, in process: the fields' refusals, every recipe's task training adapters
on a 4-bit base that stays bit for bit what it loaded as, the exports, the measured storage against ``toolkit plan``,
and bitsandbytes' 8-bit AdamW."""

import pytest
import torch

from toolkit.errors import ConfigError

pytest.importorskip("bitsandbytes")

QLORA = dict(use_peft=True, load_in_4bit=True, use_bnb_nested_quant=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
             lora_target_modules="all-linear")
RUN = dict(optim="adamw_torch", learning_rate=5e-2, max_train_samples=4, max_eval_samples=4, lr_scheduler_type="constant", max_steps=4, logging_steps=1,
           per_device_train_batch_size=4, gradient_accumulation_steps=1, report_to="none", packing=False,
           block_size=64, plot=False, seed=3)


class _Watch:
    """The quantized base's stored weights and the trainable tensors, when the run starts and when it ends."""

    def on_prepared(self, accelerator, model, optimizer):
        self.model = accelerator.unwrap_model(model)
        self.before = self._state()
        self.optimizer = optimizer

    def on_end(self, accelerator, model, summary):
        self.after = self._state()

    def _state(self):
        # as bytes: 4-bit weights packed into float32 storage hold NaN patterns, which torch.equal calls unequal
        frozen = {n: p.detach().view(torch.uint8).clone() for n, p in self.model.named_parameters()
                  if not p.requires_grad}
        trained = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        return frozen, trained


def _train(values, task=None):
    from helpers import train_in_process

    from toolkit.metrics import read_metrics

    watch = _Watch()
    summary = train_in_process(values, callbacks=[watch], task=task)
    losses = [r["loss"] for r in read_metrics(values["output_dir"]) if "loss" in r]
    return watch, summary, losses


def _assert_adapters_trained_base_frozen(watch, heads=()):
    import bitsandbytes as bnb

    quantized = [m for m in watch.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized and all(not m.weight.requires_grad for m in quantized)
    frozen_before, trained_before = watch.before
    frozen_after, trained_after = watch.after
    changed = [n for n in frozen_before if not torch.equal(frozen_before[n], frozen_after[n])]
    assert not changed, changed  # the base, bit for bit
    assert trained_before and all("lora_" in n or any(h in n for h in heads) for n in trained_before), trained_before
    moved = {n for n in trained_before if not torch.equal(trained_before[n], trained_after[n])}
    assert any("lora_B" in n for n in moved) and all(any(h in n for h in heads) for h in heads for n in moved
                                                       if h in n)
    return moved


@pytest.mark.slow
def test_causal_lm_trains_adapters_on_a_4bit_base(tiny_llama, padded_data, tmp_path):
    """Loss on the same 4 rows goes down, the adapters move, the 4-bit weights (Params4bit) stay bit for bit as loaded."""
    watch, summary, losses = _train({**RUN, **QLORA, **padded_data, "model_name_or_path": tiny_llama,
                                     "output_dir": str(tmp_path / "lm"), "save_final_model": False})
    _assert_adapters_trained_base_frozen(watch)
    assert losses[-1] < losses[0], losses
    assert watch.model.is_loaded_in_4bit


def test_quantized_fields_are_refused_where_they_cannot_work(tiny_llama):
    from toolkit.config import ModelArguments

    with pytest.raises(ConfigError, match="load_in_4bit: a quantized base cannot be trained, only adapters"):
        ModelArguments(model_name_or_path=tiny_llama, load_in_4bit=True)
    with pytest.raises(ConfigError, match="load_in_8bit: choose one of load_in_4bit and load_in_8bit"):
        ModelArguments(model_name_or_path=tiny_llama, use_peft=True, load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(ConfigError, match="bnb_4bit_quant_type: "):
        ModelArguments(model_name_or_path=tiny_llama, use_peft=True, load_in_4bit=True, bnb_4bit_quant_type="int4")
