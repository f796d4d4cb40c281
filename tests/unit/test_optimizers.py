"""optim muon (toolkit/training/optimizers.py), in process: the split, torch's Muon run unchanged but for the
Newton-Schulz dtype, the fields' defaults against torch's, and the refusals. The launched proofs (DDP and FSDP2
against one process, the bf16 spread, resume) are tests/launch/test_muon.py's."""

import copy
import inspect
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolkit.config import TrainingArguments
from toolkit.errors import ConfigError
from toolkit.training.optimizers import MuonWithAdamW, NewtonSchulzDtype, build_muon, muon_split


def args(**fields) -> TrainingArguments:
    return TrainingArguments(output_dir="unused", optim="muon", **fields)


def test_fields_default_to_torchs_muon():
    """Each muon_* field's default is torch.optim.Muon's (and torch's Newton-Schulz constants)."""
    from torch.optim import _muon

    torch_defaults = {k: v.default for k, v in inspect.signature(torch.optim.Muon).parameters.items()}
    a = args()
    assert (a.muon_momentum, a.muon_nesterov, a.muon_ns_steps, a.muon_eps) == (
        torch_defaults["momentum"], torch_defaults["nesterov"], torch_defaults["ns_steps"], torch_defaults["eps"])
    assert tuple(a.muon_ns_coefficients) == torch_defaults["ns_coefficients"] == (
        _muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    # torch's None is "original" (_adjust_lr), the iterations' dtype bfloat16 (grad.bfloat16())
    assert torch_defaults["adjust_lr_fn"] is None and a.muon_adjust_lr_fn == "original"
    assert a.muon_ns_dtype == "bfloat16"


@pytest.mark.parametrize("fields, field", [
    (dict(muon_momentum=1.0), "muon_momentum"), (dict(muon_ns_steps=0), "muon_ns_steps"),
    (dict(muon_ns_steps=100), "muon_ns_steps"), (dict(muon_ns_coefficients=[1.0, 2.0]), "muon_ns_coefficients"),
    (dict(muon_ns_coefficients=[1.0, float("nan"), 2.0]), "muon_ns_coefficients"),
    (dict(muon_eps=0.0), "muon_eps"), (dict(muon_adjust_lr_fn="none"), "muon_adjust_lr_fn"),
    (dict(muon_ns_dtype="float16"), "muon_ns_dtype"), (dict(muon_adamw_learning_rate=-1.0), "muon_adamw_learning_rate"),
    (dict(pipeline_parallel_size=2, gradient_accumulation_steps=2), "optim")])
def test_bad_muon_fields_are_refused_naming_the_field(fields, field):
    with pytest.raises(ConfigError) as e:
        args(**fields)
    assert e.value.field_name == field


def _names(model, pairs):
    return [n for n, _ in pairs]


def test_split_muon_on_hidden_matrices_adamw_on_embeddings_head_norms_biases(tiny_model, tiny_llama):
    """GPT-2 (tied head, position embeddings, Conv1D weights) and Llama (untied head, no biases)."""
    gpt2 = AutoModelForCausalLM.from_pretrained(tiny_model)
    muon, adamw_2d, others = muon_split(gpt2)
    assert _names(gpt2, adamw_2d) == ["transformer.wte.weight", "transformer.wpe.weight"]  # lm_head is wte
    assert {n.split(".", 3)[-1] for n in _names(gpt2, muon)} == {
        "attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}
    assert all(p.ndim == 1 for _, p in others) and any("ln_f" in n for n in _names(gpt2, others))
    llama = AutoModelForCausalLM.from_pretrained(tiny_llama)
    muon, adamw_2d, others = muon_split(llama)
    assert _names(llama, adamw_2d) == ["model.embed_tokens.weight", "lm_head.weight"]
    assert len(muon) == 7 * 2 and all(p.ndim == 2 for _, p in muon)  # q k v o gate up down, 2 layers
    everything = {n for n, p in llama.named_parameters()}
    assert set(_names(llama, muon + adamw_2d + others)) == everything


def test_split_is_printed_with_each_groups_count(tiny_model):
    gpt2 = AutoModelForCausalLM.from_pretrained(tiny_model)
    optimizer = build_muon(gpt2, args(muon_ns_dtype="float32"))
    muon, adamw_2d, others = muon_split(gpt2)
    n_muon = sum(p.numel() for _, p in muon)
    assert f"Muon on the hidden 2-D weights ({n_muon:,} parameters in {len(muon)} tensors" in optimizer.split
    assert f"({sum(p.numel() for _, p in adamw_2d + others):,} parameters" in optimizer.split
    assert [g["use_muon"] for g in optimizer.param_groups] == [True, False, False]


def test_a_model_without_an_output_head_is_refused():
    with pytest.raises(ConfigError) as e:
        muon_split(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert e.value.field_name == "optim" and "get_output_embeddings" in str(e.value)


class Tiny(torch.nn.Module):
    """An embedding, two hidden matrices (one tall, one wide: torch transposes the tall one), a norm, a head."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(11, 8)
        self.up, self.down = torch.nn.Linear(8, 24), torch.nn.Linear(24, 8, bias=False)
        self.norm, self.head = torch.nn.LayerNorm(8), torch.nn.Linear(8, 11, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.to(dtype)

    def get_output_embeddings(self):
        return self.head

    def loss(self, step):
        ids = torch.arange(step, step + 6) % 11
        h = self.norm(self.down(torch.relu(self.up(self.embed(ids)))))
        return torch.nn.functional.cross_entropy(self.head(h).float(), (ids + 1) % 11)


def _train(model, optimizer, steps=3):
    for step in range(steps):
        optimizer.zero_grad()
        model.loss(step).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


MUON = dict(lr=0.05, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)


def _ours(model, ns_dtype, muon=MUON):
    return MuonWithAdamW([model.up.weight, model.down.weight],
                         [{"params": [model.embed.weight, model.head.weight], "weight_decay": 0.1},
                          {"params": [model.up.bias, *model.norm.parameters()], "weight_decay": 0.0}],
                         ns_dtype=ns_dtype, muon=muon, adamw=ADAMW)


def test_bfloat16_is_torchs_muon_and_adamw_bit_for_bit():
    """muon_ns_dtype bfloat16: the same bits as torch.optim.Muon and torch.optim.AdamW stepped side by side."""
    a, b = Tiny(), Tiny()
    ours = _train(a, _ours(a, torch.bfloat16))
    muon = torch.optim.Muon([b.up.weight, b.down.weight], **MUON)
    adamw = torch.optim.AdamW([{"params": [b.embed.weight, b.head.weight], "weight_decay": 0.1},
                               {"params": [b.up.bias, *b.norm.parameters()], "weight_decay": 0.0}], **ADAMW)
    for step in range(3):
        muon.zero_grad(), adamw.zero_grad()
        b.loss(step).backward()
        muon.step(), adamw.step()
    assert all(torch.equal(ours[n], p) for n, p in b.named_parameters())
    assert not torch.equal(ours["up.weight"], Tiny().up.weight), "it must train"


def _reference_muon(model, steps=3):
    """torch.optim.Muon's docstring algorithm, written out here in float64 (AdamW on the rest, torch's, in float64)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    matrices = [model.up.weight, model.down.weight]
    bufs = [torch.zeros_like(p) for p in matrices]
    adamw = torch.optim.AdamW([{"params": [model.embed.weight, model.head.weight], "weight_decay": 0.1},
                               {"params": [model.up.bias, *model.norm.parameters()], "weight_decay": 0.0}], **ADAMW)
    for step in range(steps):
        adamw.zero_grad(), [p.grad is not None and p.grad.zero_() for p in matrices]
        model.loss(step).backward()
        with torch.no_grad():
            for p, buf in zip(matrices, bufs):
                buf.mul_(0.95).add_(p.grad, alpha=0.05)
                x = p.grad + 0.95 * (buf - p.grad)  # nesterov: grad.lerp(buf, momentum)
                x = x.T if x.shape[0] > x.shape[1] else x
                x = x / x.norm().clamp(min=1e-7)
                for _ in range(5):
                    gram = x @ x.T
                    x = a * x + (b * gram + c * gram @ gram) @ x
                x = x.T if p.shape[0] > p.shape[1] else x
                p.mul_(1 - 0.05 * 0.1).add_(x, alpha=-0.05 * 0.2 * math.sqrt(max(p.shape)))
        adamw.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_float32_iterations_are_torchs_muon_in_another_dtype():
    """The mode changes the iterations' dtype and nothing else: run in float64 it equals the docstring's algorithm
    written out here (1e-12); in float32 it is that to fp32 rounding, while torch's bfloat16 is visibly off."""
    reference = _reference_muon(Tiny(torch.float64))
    model64 = Tiny(torch.float64)
    ours64 = _train(model64, _ours(model64, torch.float64))
    assert max(float((ours64[n] - reference[n]).abs().max()) for n in reference) < 1e-12
    model32, model16 = Tiny(), Tiny()
    ours32, torchs = _train(model32, _ours(model32, torch.float32)), _train(model16, _ours(model16, torch.bfloat16))
    muon = ["up.weight", "down.weight"]
    fp32 = max(float((ours32[n].double() - reference[n]).abs().max()) for n in muon)
    bf16 = max(float((torchs[n].double() - reference[n]).abs().max()) for n in muon)
    print(f"from float64's: float32 iterations {fp32:.1e}, torch's bfloat16 {bf16:.1e}")
    assert fp32 < 1e-6 < 1e-4 < bf16


def test_bfloat16_weights_keep_their_momentum():
    """torch's Muon on a bf16 weight without Nesterov normalises the momentum buffer in place (``buf.bfloat16()`` is
    the buffer itself; the iterations' first ``div_`` divides it by its norm): after one step it holds norm 1, not
    (1 - momentum) x the gradient. Here the iterations get a copy."""
    plain = dict(MUON, nesterov=False)
    model = Tiny(torch.bfloat16)
    optimizer = _ours(model, torch.bfloat16, muon=plain)
    model.loss(0).backward()
    grad = model.up.weight.grad.clone()
    optimizer.step()
    buf = optimizer.state[model.up.weight]["momentum_buffer"]
    assert torch.equal(buf, grad.lerp(torch.zeros_like(grad), 0.95))  # what lerp_ from zeros gives
    alone = torch.nn.Parameter(model.up.weight.detach().clone())
    alone.grad = grad.clone()
    torchs = torch.optim.Muon([alone], **plain)
    torchs.step()
    assert float(torchs.state[alone]["momentum_buffer"].float().norm()) == pytest.approx(1.0, abs=1e-2)


def test_state_dict_round_trip_continues_exactly():
    """Saved after 2 steps and loaded into a fresh optimizer (as a resume does): step 3 gives the same bits."""
    a = Tiny()
    optimizer = _ours(a, torch.float32)
    _train(a, optimizer, steps=2)
    saved, weights = optimizer.state_dict(), {n: p.detach().clone() for n, p in a.named_parameters()}
    assert {k for s in saved["state"].values() for k in s} == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    b = Tiny()
    with torch.no_grad():
        for n, p in b.named_parameters():
            p.copy_(weights[n])
    fresh = _ours(b, torch.float32)
    fresh.load_state_dict(copy.deepcopy(saved))  # a resume reads it from disk: no tensor shared with a
    for model, opt in ((a, optimizer), (b, fresh)):
        opt.zero_grad()
        model.loss(2).backward()
        opt.step()
    assert all(torch.equal(p, dict(b.named_parameters())[n]) for n, p in a.named_parameters())


def test_the_mode_touches_only_bfloat16_casts():
    with NewtonSchulzDtype(torch.float32):
        x = torch.ones(2, dtype=torch.float32)
        y = x.bfloat16()
        z = x.to(torch.bfloat16)
    assert y.dtype == torch.float32 and y is not x and z.dtype == torch.bfloat16


def test_muon_is_refused_where_it_is_not_proven_naming_the_launches_that_work(capsys, tmp_path, tiny_llama,
                                                                              padded_data):
    """ZeRO hands the optimizer flat 1-D partitions (DeepSpeed's own Muon is another definition), FSDP1 flat shards:
    one line, exit 2, before any launch (toolkit train; the ranks run the same check_launch); the launches that work
    pass the same check."""
    from toolkit.cli import train as launch

    argv = ["lm", "--model", tiny_llama, "--dataset", padded_data["train_file"], "--output_dir", str(tmp_path / "o"),
            "--optim", "muon", "--strategy", "zero2", "--num_processes", "2"]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["config error: optim: muon runs on one process, ddp.yaml, fsdp.yaml (FSDP2), hsdp.yaml or tp.yaml; "
                   "this launch is deepspeed-zero2: launch with one of those, or use optim adamw_torch"], err
    fields = ["--model_name_or_path", tiny_llama, "--train_file", padded_data["train_file"], "--output_dir",
              str(tmp_path / "o"), "--optim", "muon", "--per_device_train_batch_size", "2"]  # 4 ranks: 8 of 23 rows
    for refused, name in (("zero3", "deepspeed-zero3"), ("fsdp1", "fsdp1")):
        with pytest.raises(ConfigError, match=f"^optim: muon runs on .* this launch is {name}:"):
            launch.check("causal-lm", launch.strategy_config(refused), 2, fields)
    for works, processes in (("ddp", 2), ("fsdp", 2), ("hsdp", 4), ("tp", 2)):
        launch.check("causal-lm", launch.strategy_config(works), processes, fields)


def test_muon_for_a_classifier_is_refused_before_launching(capsys, tmp_path, tiny_model, classify_files):
    """A classifier has no output head (get_output_embeddings) for muon_split to keep on AdamW: one line naming optim,
    exit 2, from toolkit train's check (the task's check, which the recipe runs too), not in the ranks after the
    weights load."""
    from toolkit.cli import train as launch

    fields = ["--model_name_or_path", tiny_model, "--train_file", classify_files["train_file"], "--output_dir",
              str(tmp_path / "o"), "--optim", "muon"]
    with pytest.raises(ConfigError, match="^optim: muon needs a causal LM's output head"):  # the check, in process
        launch.check("sequence-classification", launch.strategy_config("ddp"), 2, fields)
    argv = ["classify", "--model", tiny_model, "--dataset", classify_files["train_file"], "--output_dir",
            str(tmp_path / "o"), "--optim", "muon", "--strategy", "ddp", "--num_processes", "2"]
    assert launch.main(argv) == 2  # and toolkit train's line
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "config error: optim: muon needs a causal LM's output head; the classifier has none (its score layer would "
        "get Muon): use optim adamw_torch"], captured.err
    assert "launching" not in captured.out


def test_muon_with_lora_is_refused(tmp_path, tiny_llama, padded_data):
    from toolkit.config import config_from_dict

    with pytest.raises(ConfigError) as e:
        config_from_dict({"model_name_or_path": tiny_llama, "train_file": padded_data["train_file"],
                          "output_dir": str(tmp_path / "o"), "optim": "muon", "use_peft": True})
    assert e.value.field_name == "optim" and "use_peft" in str(e.value)


@pytest.mark.slow  # four in-process runs
def test_resume_with_another_optimizer_is_refused_before_the_weights(tmp_path, tiny_model, padded_data):
    """A checkpoint of optim muon resumed with adamw_torch (or the other way) is refused naming optim: torch's
    load_state_dict would fail with its own message after the weights loaded (other groups, other state)."""
    import shutil

    from helpers import train_in_process

    values = {"model_name_or_path": tiny_model, "train_file": padded_data["train_file"], "block_size": 48,
              "per_device_train_batch_size": 4, "max_steps": 1, "save_steps": 1, "report_to": "none", "plot": False,
              "save_final_model": False, "learning_rate": 0.02}
    for written, resumed in (("muon", "adamw_torch"), ("adamw_torch", "muon")):
        out = tmp_path / written
        train_in_process({**values, "optim": written, "output_dir": str(out)})
        copy = tmp_path / f"{written}-resumed"
        shutil.copytree(out / "checkpoints", copy / "checkpoints")
        with pytest.raises(ConfigError, match="^optim: cannot resume from .*: it was written with optim "):
            train_in_process({**values, "optim": resumed, "output_dir": str(copy), "max_steps": 2,
                              "resume_from_checkpoint": "latest"})
        assert not (copy / "metrics.jsonl").exists()


def test_owner_ranks_balance_the_iterations_and_shards_split_as_dtensor_splits():
    """The owner scheme's bookkeeping (toolkit.training.newton_schulz; run for real under FSDP2, HSDP and TP in
    tests/launch/test_muon.py): owners by the iterations' cost (each rank within one largest matrix of the others,
    the same answer from the same shapes), and each rank's piece of a sharded dimension as DTensor's Shard cuts it
    (torch.chunk, then empty pieces: 5 rows over 4 ranks are 2, 2, 1, 0)."""
    from torch.distributed.tensor import Shard

    from toolkit.training.newton_schulz import _sizes, assign_owners, ns_cost

    shapes = [(4096, 11008)] * 3 + [(4096, 4096)] * 4 + [(1024, 4096)] * 5
    for world in (2, 3, 4):
        owners = assign_owners(shapes, world)
        assert owners == assign_owners(list(shapes), world) and set(owners) == set(range(world))
        load = [sum(ns_cost(s) for s, o in zip(shapes, owners) if o == r) for r in range(world)]
        assert max(load) - min(load) <= ns_cost(shapes[0])
    for rows in (1, 5, 8, 11):
        for world in (2, 3, 4):
            pieces = Shard(0)._split_tensor(torch.zeros(rows, 3), world, with_padding=False)[0]
            assert _sizes(rows, world) == [p.shape[0] for p in pieces]


def test_owner_scatter_receives_on_the_shards_device():
    """The owner scheme's scattered shard is received on the device of the shard it updates (under NCCL a GPU's:
    a host buffer there fails the scatter, and the weight's ``add_``). Before, it was allocated on the host whatever
    the device: every FSDP2, HSDP and TP Muon step on GPUs would fail at its first scatter (gloo CPU ranks could
    not show it). Here the device is ``meta`` on torch's fake process group of 2 ranks (no GPU on this machine):
    the receive buffer must be a meta tensor too (a host one cannot take the meta pieces: fake_pg copies them)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from toolkit.training.newton_schulz import scatter_from_owner

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        whole = torch.zeros(5, 3, device="meta")  # 5 rows over 2 ranks: 3 and 2
        mine = scatter_from_owner(whole, (3, 3), (5, 3), 0, None, 0, torch.float32, whole.device)
        assert mine.device.type == "meta" and mine.shape == (3, 3)
    finally:
        dist.destroy_process_group()
