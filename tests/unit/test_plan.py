"""``python -m toolkit plan``: the arithmetic on a 7B Llama config (meta device, no weights), and the command.

The command itself: tests/launch/test_plan_launch.py. The per-rank bytes measured on real 2-rank runs are compared in
tests/launch/test_strategies.py (``test_plan_predicts_the_model_states_each_rank_holds``)."""

import pytest

from toolkit.cli.plan import activation_bytes, count_model, model_states_per_device, plan


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
    # the recipes' default targets for Llama (peft's): r x (in + out) over q_proj and v_proj (4096 x 4096), 32 layers
    assert count_model(llama7b, lora_r=16).trainable == 32 * 16 * 2 * 8192
    m = count_model(llama7b, lora_r=16, lora_target_modules=["all-linear"])
    # all-linear: q, k, v, o (4096 x 4096) and gate, up (4096 -> 11008), down (11008 -> 4096), 32 layers
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
    assert one_node["TP"]["config"].endswith("tp.yaml --parallelism_config_tp_size 8 --num_processes 8 "
                                             "--mixed_precision bf16")


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


NAMED_TARGETS = {"llama": ["k_proj", "down_proj"], "gpt2": ["c_fc"], "bert-classifier": ["key", "dense"]}


@pytest.mark.parametrize("targets", ["default", "all-linear", "named"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert-classifier"])
def test_lora_count_is_what_the_recipe_trains(tmp_path, kind, targets):
    """``--lora-r`` counts what ``toolkit.models.lora.apply_lora`` leaves trainable (peft, on real weights) for the same model
    and fields: peft's default targets for the model type (Llama's q_proj and v_proj, GPT-2's c_attn, BERT's query and
    value plus the classifier head it trains in full), all-linear, or a list."""
    import transformers

    from toolkit.config import ModelArguments
    from toolkit.models.lora import apply_lora

    targets = {"default": None, "all-linear": ["all-linear"], "named": NAMED_TARGETS[kind]}[targets]
    config = {"llama": transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
              "gpt2": transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=64),
              "bert-classifier": transformers.BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                                                         num_attention_heads=2, intermediate_size=48, num_labels=3,
                                                         architectures=["BertForSequenceClassification"])}[kind]
    auto, task = ((transformers.AutoModelForSequenceClassification, "SEQ_CLS") if kind == "bert-classifier" else
                  (transformers.AutoModelForCausalLM, "CAUSAL_LM"))
    config.save_pretrained(tmp_path)  # what the plan reads
    args = ModelArguments(model_name_or_path=str(tmp_path), use_peft=True, lora_r=4, lora_target_modules=targets)
    model = auto.from_config(config)  # real weights, as the recipe's would be
    base = sum(p.numel() for p in model.parameters())
    trained = apply_lora(model, args, task, log=lambda *_: None)
    expected = sum(p.numel() for p in trained.parameters() if p.requires_grad)
    m = count_model(str(tmp_path), lora_r=4, lora_target_modules=targets)
    assert m.trainable == expected
    assert m.params == base + expected  # the adapters (and a head trained in full) counted once more as weights


@pytest.mark.parametrize("nodes", [1, 2])
def test_launch_options_run_what_was_planned(llama7b, monkeypatch, nodes):
    """Each strategy's launch options, read by accelerate launch's own parser and config merge, start the planned
    number of processes with the planned mixed precision (the configs ship with 2 processes and 'no')."""
    import shlex

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from helpers import ROOT

    monkeypatch.chdir(ROOT)  # the options name accelerate_configs/ relative to the repository, as the README's commands
    m = count_model(llama7b)
    for precision, mixed in (("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "no")):
        for row in plan(m, 8, 80e9, nodes=nodes, precision=precision):
            if row["config"] is None:
                continue
            args = launch_command_parser().parse_args(shlex.split(row["config"]) + ["recipes/gpt2.py"])
            args, _, _ = _validate_launch_command(args)
            assert (args.num_processes, args.num_machines, args.mixed_precision) == (8 * nodes, nodes, mixed), row
            if row["strategy"].startswith("ZeRO"):
                assert args.use_deepspeed and int(args.zero_stage) == int(row["strategy"][5]), row


def test_dpo_counts_its_live_reference_sharded_like_the_weights(llama7b, capsys):
    """--recipe dpo: the live reference copy adds weights only (no gradients, no optimizer state), whole under DDP
    and ZeRO-2 (a stage-0 engine: 2-byte weights under bf16), an eighth under ZeRO-3 and FSDP2 on 8; TP is refused
    (precompute); nothing with LoRA or --precompute-ref-log-probs."""
    from toolkit.cli.plan import main

    m = count_model(llama7b)
    plain = {r["strategy"]: r for r in plan(m, 8, 80e9)}
    dpo = {r["strategy"]: r for r in plan(m, 8, 80e9, reference=True)}
    assert dpo["DDP"]["reference"] == 4 * m.params and dpo["ZeRO-2"]["reference"] == 2 * m.params
    assert dpo["ZeRO-3"]["reference"] == 2 * m.params / 8 and dpo["FSDP2"]["reference"] == 4 * m.params / 8
    for name in ("DDP", "ZeRO-2", "ZeRO-3", "FSDP2"):
        assert dpo[name]["model_states"] == plain[name]["model_states"] + dpo[name]["reference"], name
    assert dpo["TP"]["config"] is None and dpo["TP"]["fits"] == "n/a" and plain["TP"]["config"] is not None
    for extra in ([], ["--lora-r", "16"], ["--precompute-ref-log-probs"]):
        assert main(["--model", llama7b, "--gpus", "8", "--gpu-memory", "80GB", "--recipe", "dpo", *extra]) == 0
    printed = capsys.readouterr().out.split("GB (10^9 bytes)")[1:]
    ddp = [next(line.split() for line in text.splitlines() if line.startswith("DDP ")) for text in printed]
    assert [row[4] for row in ddp] == [f"{4 * m.params / 1e9:.2f}", "0.00", "0.00"]  # the ref column
    assert "--precompute_ref_log_probs true" in printed[2] and "precompute-ref-log-probs" in printed[0]


def _save(config, folder) -> str:
    config.save_pretrained(folder)
    return str(folder)


def test_tp_is_offered_only_where_the_heads_divide(tmp_path):
    """TP over t devices needs t to divide the attention and the KV heads (each rank holds whole heads: the recipe
    refuses the rest at load, toolkit.models.loading.tensor_parallel_problem); a model without a TP plan gets none. SmolLM2's
    shape (9 heads, 3 KV heads) on 8 devices: not offered, saying why and which tp sizes divide; on 3: offered. The
    MLP width (1536 here) need not divide: transformers' column- and row-wise shards take an uneven split."""
    from transformers import GPT2Config, LlamaConfig

    smol = count_model(_save(LlamaConfig(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                         num_attention_heads=9, num_key_value_heads=3), tmp_path / "smol"))
    tp8 = {r["strategy"]: r for r in plan(smol, 8, 80e9)}["TP"]
    assert tp8["config"] is None and tp8["fits"] == tp8["fits_other"] == "n/a"
    assert tp8["why_not"] == ("tp_size 8 does not divide this llama model's heads (num_attention_heads 9, "
                              "num_key_value_heads 3): each rank holds whole heads, so tp_size must divide each (1, 3)")
    tp3 = {r["strategy"]: r for r in plan(smol, 3, 80e9)}["TP"]
    assert tp3["config"].startswith("--config_file accelerate_configs/tp.yaml --parallelism_config_tp_size 3 ")
    assert tp3["fits"] == "yes" and tp3["why_not"] is None
    gpt2 = count_model(_save(GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4), tmp_path / "gpt2"))
    tp = {r["strategy"]: r for r in plan(gpt2, 4, 80e9)}["TP"]
    assert tp["config"] is None and "a gpt2 model has no tensor-parallel plan" in tp["why_not"]


def test_the_plan_ends_with_one_runnable_command(llama7b, monkeypatch, capsys):
    """The recommended layout (the first that fits, least communication first) as one whole command: accelerate
    launch's options, the recipe, its shipped config and the planned fields; accelerate's parser and the recipe's
    own config parser both take it."""
    import shlex

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from helpers import ROOT

    from toolkit.cli.plan import main
    from toolkit.config import parse_args

    monkeypatch.chdir(ROOT)
    assert main(["--model", llama7b, "--gpus", "8", "--gpu-memory", "80GB", "--recipe", "sft",
                 "--gradient-checkpointing"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("recommended: "))
    rows = {r["strategy"]: r for r in plan(count_model(llama7b), 8, 80e9, checkpointing=True)}
    assert rows["DDP"]["fits"] == "no" and rows["ZeRO-1"]["fits"] == "yes"  # DDP's 108 GB do not fit, ZeRO-1's do
    assert lines[at].startswith("recommended: ZeRO-1 (fits;")
    command = shlex.split(lines[at + 1])
    assert command[:2] == ["accelerate", "launch"]
    script = command.index("recipes/sft.py")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(command[2:script + 1]))
    assert (args.num_processes, args.mixed_precision, int(args.zero_stage)) == (8, "bf16", 1)
    assert args.config_file == "accelerate_configs/zero2.yaml"
    cfg = parse_args(command[script + 1:])
    assert cfg.model.model_name_or_path == llama7b and cfg.train.per_device_train_batch_size == 4
    assert cfg.data.block_size == 2048 and cfg.train.gradient_checkpointing is True
    assert command[script + 1:script + 3] == ["--config", "recipes/configs/sft_smollm2.yaml"]


def test_load_in_4bit_counts_the_quantized_base_as_bitsandbytes_holds_it(llama7b, tmp_path):
    """--load-in-4bit: the base's linear layers at 0.5 byte a weight plus one fp32 absmax per 64 (0.5625), with double
    quantization one byte per 64 plus the second level (0.5159); the head, embeddings and norms as before; refused
    outside DDP, ZeRO-2 and FSDP2. On CPU the storage of a model loaded in 4 bits (weights and constants, measured
    tensor by tensor) is within 3% of the count, with and without double quantization."""
    pytest.importorskip("bitsandbytes")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.config import ModelArguments
    from toolkit.models.loading import load_model
    from toolkit.models.quantization import quantized_bytes

    full = count_model(llama7b, lora_r=16)
    for nested, per_weight in ((False, 0.5625), (True, 0.5159)):
        m = count_model(llama7b, lora_r=16, quantize_bits=4, nested=nested)
        assert m.quantized == 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # every linear layer but the head
        assert m.quantized_bytes / m.quantized == pytest.approx(per_weight, abs=1e-4)
        rows = {r["strategy"]: r for r in plan(m, 1, 24e9, precision="fp32")}
        assert rows["DDP"]["weights"] == 4 * (full.params - m.quantized) + m.quantized_bytes
        assert rows["ZeRO-3"]["config"] is None and "refused under ZeRO-3" in rows["ZeRO-3"]["why_not"]
    folder = str(tmp_path / "llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=640, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(folder)
    for nested in (False, True):
        planned = count_model(folder, lora_r=4, quantize_bits=4, nested=nested)
        model = load_model(ModelArguments(model_name_or_path=folder, use_peft=True, load_in_4bit=True,
                                          use_bnb_nested_quant=nested))
        held = quantized_bytes(model)
        assert held["params"] == planned.quantized
        measured = held["weights"] + held["constants"]
        assert abs(measured - planned.quantized_bytes) <= 0.03 * planned.quantized_bytes, (nested, measured, planned)


def test_plan_load_in_4bit_command(llama7b, capsys):
    """--load-in-4bit needs --lora-r (a quantized base trains adapters only) and no pipeline; with it the plan prints
    the base's bytes per quantized weight and the recommended command carries the fields (--load_in_4bit true ...)."""
    pytest.importorskip("bitsandbytes")
    from toolkit.cli.plan import main

    assert main(["--model", llama7b, "--gpus", "1", "--gpu-memory", "24GB", "--load-in-4bit"]) == 2
    assert "plan error: load_in_4bit: a quantized base cannot be trained, only adapters on it: add --lora-r" in (
        capsys.readouterr().err)
    # nor planned into a pipeline, which the recipes refuse with a quantized base
    assert main(["--model", llama7b, "--gpus", "2", "--gpu-memory", "24GB", "--lora-r", "16", "--load-in-4bit",
                 "--pipeline-parallel-size", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "plan error: load_in_4bit: a 4bit base is not supported under pipeline parallelism: drop "
        "--pipeline-parallel-size, or --load-in-4bit"]
    assert main(["--model", llama7b, "--gpus", "1", "--gpu-memory", "24GB", "--lora-r", "16", "--load-in-4bit",
                 "--use-bnb-nested-quant", "--gradient-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "4-bit base: 6.476 B weights quantized at 0.5159 bytes each" in out
    assert "--use_peft true --lora_r 16 --load_in_4bit true --use_bnb_nested_quant true" in out


def test_muon_counts_one_momentum_buffer_for_its_group_and_refuses_zero(llama7b, capsys):
    """--optim muon: Muon's group (the 7 hidden matrices of each of the 32 layers) holds 4 bytes a parameter, AdamW's
    (embeddings, head, norms) 8; the largest matrix's Newton-Schulz working set (the 11008 x 4096 MLP: 3 R C + 2 m^2
    fp32) on every device, and on the sharded layouts the matrices an owner rank gathers; the ZeRO rows refused."""
    from toolkit.cli.plan import main

    adamw, m = count_model(llama7b), count_model(llama7b, optim="muon")
    assert m.muon == 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) and m.trainable == adamw.trainable
    assert m.muon_transient == 4 * (3 * 4096 * 11008 + 2 * 4096 ** 2)
    ddp = model_states_per_device(m, "DDP", 8, 8, "bf16")
    assert ddp["optimizer"] == 8 * m.trainable - 4 * m.muon
    rows = {r["strategy"]: r for r in plan(m, 8, 80e9)}
    # FSDP2 and HSDP (8 shards) and TP: an owner rank also holds the whole matrices it iterates on (1/8 of Muon's
    # group, the largest ones' imbalance and gather buffers: 3 of the 11008 x 4096); DDP every matrix whole already
    assert m.muon_largest == 4096 * 11008
    gathered = 4 * (m.muon / 8 + 3 * 4096 * 11008)
    assert rows["FSDP2"]["optimizer"] == ddp["optimizer"] / 8 + m.muon_transient + gathered
    assert rows["HSDP"]["optimizer"] == rows["TP"]["optimizer"] == rows["FSDP2"]["optimizer"]
    assert rows["DDP"]["optimizer"] == ddp["optimizer"] + m.muon_transient
    assert all(rows[s]["config"] is None and "muon" in rows[s]["why_not"] for s in rows if s.startswith("ZeRO"))
    assert main(["--model", llama7b, "--gpus", "8", "--gpu-memory", "80GB", "--optim", "muon"]) == 0
    out = capsys.readouterr().out
    assert "optim muon: 6.476 B parameters in Muon's group" in out and "--optim muon" in out.splitlines()[-1]


def test_sequence_parallel_plan_divides_every_activation_by_n(llama7b, capsys):
    """Ulysses (``--sequence-parallel-size``): each device holds s / n positions of everything but attention and the
    s x s matrices of a / n heads, so every activation (low, expected, high; with and without checkpointing) and the
    logits are / n, the model states unchanged; the DDP and FSDP2 rows with their launch commands; a head count n does
    not divide is said so."""
    from toolkit.cli.plan import main

    m = count_model(llama7b)
    for ckpt in (False, True):
        whole, split = (activation_bytes(m, 1, 32768, "bf16", ckpt, sp=n) for n in (1, 4))
        assert split == pytest.approx({case: value / 4 for case, value in whole.items()}, rel=1e-12)
    assert main(["--model", llama7b, "--gpus", "8", "--gpu-memory", "80GB", "--micro-batch", "1", "--seq-len", "32768",
                 "--gradient-checkpointing", "--sequence-parallel-size", "4"]) == 0
    out = capsys.readouterr().out.split("sequence parallel 4 (Ulysses")[1].splitlines()
    assert out[0] == ", sequence_parallel_size): each device 1/4 of every sequence; 2 data-parallel groups"
    assert [line.split()[0] for line in out[2:]] == ["DDP", "FSDP2"]
    assert out[2].endswith("--config_file accelerate_configs/ddp.yaml --num_processes 8 --mixed_precision bf16 "
                           "recipes/gpt2.py --config recipes/configs/gpt2.yaml --model_name_or_path " + llama7b +
                           " --per_device_train_batch_size 1 --block_size 32768 --gradient_checkpointing true "
                           "--sequence_parallel_size 4")
    assert main(["--model", llama7b, "--gpus", "6", "--gpu-memory", "80GB", "--sequence-parallel-size", "3"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "sequence parallel 3: needs 3 to divide the 6 devices and the model's 32 attention heads")


def test_context_parallel_plan_divides_activations_by_n_and_attention_by_n_squared(llama7b, capsys):
    """The ring (``--context-parallel-size``): each device holds s / n positions of everything, and of attention one
    step's block (s / n queries x s / n keys): the linear terms and the logits / n, the quadratic term / n^2; any head
    count (3 does not divide Llama-2's 32 heads: planned anyway); the launch names context_parallel_size; Ulysses and
    the ring together are refused as the recipes refuse them."""
    from toolkit.cli.plan import main

    m = count_model(llama7b)
    whole, ring = (activation_bytes(m, 1, 32768, "bf16", False, sp=n, ring=True) for n in (1, 4))
    assert ring["low"] == pytest.approx(whole["low"] / 4, rel=1e-12)  # "low": the linear terms and the logits

    def attention(act, positions):  # "high" - "low": the layers' quadratic term and one more logits' share (8 b s V)
        return act["high"] - act["low"] - 8 * positions * m.vocab

    assert attention(ring, 32768 / 4) == pytest.approx(attention(whole, 32768) / 16, rel=1e-12)
    assert main(["--model", llama7b, "--gpus", "6", "--gpu-memory", "80GB", "--micro-batch", "1", "--seq-len", "32768",
                 "--context-parallel-size", "3"]) == 0
    out = capsys.readouterr().out.split("context parallel 3 (ring attention")[1].splitlines()
    assert out[0] == ", context_parallel_size): each device 1/3 of every sequence; 2 data-parallel groups"
    assert [line.split()[0] for line in out[2:]] == ["DDP", "FSDP2"]
    assert out[2].endswith("--per_device_train_batch_size 1 --block_size 32768 --context_parallel_size 3")
    assert main(["--model", llama7b, "--gpus", "8", "--gpu-memory", "80GB", "--sequence-parallel-size", "2",
                 "--context-parallel-size", "2"]) == 2
    assert "context_parallel_size: ring attention with Ulysses" in capsys.readouterr().err


def test_context_parallel_plan_launches_gpt2_without_attention_dropout(tmp_path, capsys):
    """The ring refuses a model's attention dropout (GPT-2's attn_pdrop 0.1: toolkit.parallel.sequence.check_run),
    so the ring's launch commands for such a model carry --disable_dropout true (before, the command the plan
    printed was refused); Ulysses' do not need it."""
    from transformers import GPT2Config

    from toolkit.cli.plan import main

    GPT2Config(n_layer=2, n_embd=64, n_head=2).save_pretrained(tmp_path)
    assert main(["--model", str(tmp_path), "--gpus", "4", "--gpu-memory", "80GB", "--seq-len", "1024",
                 "--context-parallel-size", "2", "--sequence-parallel-size", "1"]) == 0
    out = capsys.readouterr().out.split("context parallel 2 (ring attention")[1].splitlines()
    assert [line.split()[0] for line in out[2:4]] == ["DDP", "FSDP2"]
    assert all(line.endswith("--context_parallel_size 2 --disable_dropout true") for line in out[2:4])
    assert main(["--model", str(tmp_path), "--gpus", "4", "--gpu-memory", "80GB", "--seq-len", "1024",
                 "--sequence-parallel-size", "2"]) == 0
    assert "disable_dropout" not in capsys.readouterr().out


def test_async_save_line_is_what_a_rank_stages(tiny_model, capsys):
    """--async-save: the host memory of each rank's staged checkpoint (DDP: the whole weights and AdamW state; FSDP2:
    an eighth on 8), the figure AsyncSaves logs at the first save, measured here on the tiny GPT-2 after an AdamW step
    (the bytes of DCP's get_state_dict, each storage once as dcp.async_save's stager copies it: GPT-2's tied head
    once): equal within 5% (the planner counts 8 bytes of AdamW state per parameter; the state also holds each
    tensor's step; the line rounds to 0.1 MiB)."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import AutoModelForCausalLM

    from toolkit.checkpointing.checkpoint import _tensor_bytes
    from toolkit.cli.plan import main

    assert main(["--model", tiny_model, "--gpus", "8", "--gpu-memory", "80GB", "--async-save"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("async_save: "))
    ddp, fsdp2 = (float(line.split(f"{name} ")[1].split(" GB (")[1].split(" MiB")[0]) for name in ("DDP", "FSDP2"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.arange(8).view(1, 8), labels=torch.arange(8).view(1, 8)).loss.backward()
    optimizer.step()
    staged = _tensor_bytes(dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))) / 2**20
    assert ddp == pytest.approx(staged, rel=0.05) and fsdp2 == pytest.approx(ddp / 8, abs=0.1), (line, staged)
    assert main(["--model", tiny_model, "--gpus", "8", "--gpu-memory", "80GB"]) == 0
    assert "async_save" not in capsys.readouterr().out
