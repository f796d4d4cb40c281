"""Memory switches, in one process (their multi-rank equivalence runs in test_strategies.py): each must train exactly
like the plain run, and must really do what it says (here: the layers are recomputed)."""

import copy

import pytest
import torch

from toolkit.loss import token_losses
from toolkit.models.loading import enable_activation_checkpointing


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=97))


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # dropout is on: the recompute must replay the forward's masks
    sums, _ = token_losses(model(input_ids=ids).logits, ids)
    sums.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_recomputes_and_keeps_the_gradients():
    plain = _tiny_gpt2().train()
    checkpointed = copy.deepcopy(plain)
    enable_activation_checkpointing(checkpointed)
    calls = []
    for model in (plain, checkpointed):
        model.transformer.h[0].attn.register_forward_hook(lambda *a, m=model: calls.append(m))
    ids = torch.randint(0, 97, (3, 16))
    want, got = _grads(plain, ids), _grads(checkpointed, ids)
    assert calls.count(plain) == 1 and calls.count(checkpointed) == 2, "the checkpointed layer runs again in backward"
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
    assert checkpointed.config.use_cache is False


def test_chunked_loss_equals_the_full_loss_and_its_gradients():
    """Chunks that split rows, a last partial chunk, padding: the same per-row sums and gradients as the logits path;
    the model's own forward (no labels) is untouched."""
    from toolkit.models.loading import enable_chunked_loss

    plain = _tiny_gpt2().eval()
    chunked = copy.deepcopy(plain)
    enable_chunked_loss(chunked, 7)  # 3 rows x 16 positions = 48 = 6 chunks of 7 + one of 6
    ids = torch.randint(0, 97, (3, 16))
    mask = torch.ones_like(ids)
    mask[2, 10:] = 0
    labels = ids.masked_fill(mask == 0, -100)

    want, want_targets = token_losses(plain(input_ids=ids, attention_mask=mask).logits, labels)
    out = chunked(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.allclose(out["row_loss"], want, rtol=1e-6, atol=0) and torch.equal(out["row_targets"], want_targets)
    want.sum().backward()
    out["row_loss"].sum().backward()
    # Chunks sum the head's gradient in another order: fp32 rounding of O(1) summands leaves ~1e-7 of absolute error,
    # which an element near zero cannot meet relative to itself (on an AMD EPYC: 1.5e-7 where rtol 1e-5 allowed
    # 1.3e-7). So the bound is relative to the tensor's largest gradient (measured worst: 1.6e-7 of it); a lost
    # chunk, a wrong count or a missing mask is off by O(1).
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6 * float(p.grad.abs().max())), name
    assert torch.equal(chunked(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert "forward" not in chunked.state_dict() and chunked.state_dict().keys() == plain.state_dict().keys()


def test_chunked_loss_runs_the_same_number_of_chunks_for_every_length():
    """Under ZeRO-3 every call of the head all-gathers its weight, so a rank with shorter rows must still make as many
    calls as the longest micro-batch needs: the chunks past its data are empty, and the sums do not change."""
    from toolkit.loss import chunked_token_losses

    model = _tiny_gpt2().eval()
    head, calls = model.get_output_embeddings(), []
    head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    ids = torch.randint(0, 97, (2, 5))
    hidden = model.base_model(input_ids=ids).last_hidden_state
    want, targets = chunked_token_losses(hidden, head, ids, chunk_size=4)
    assert calls == [4, 4, 2]
    calls.clear()
    got, got_targets = chunked_token_losses(hidden, head, ids, chunk_size=4, num_chunks=6)  # room for 2 x 12
    assert calls == [4, 4, 2, 0, 0, 0] and torch.equal(got, want) and torch.equal(got_targets, targets)
    got.sum().backward()  # the empty chunks recompute (and, under ZeRO-3, gather) in the backward pass too
    assert calls[6:] == [0, 0, 0, 2, 4, 4]  # last chunk first: the same order on every rank
    with pytest.raises(ValueError, match="needs 3 chunks of 4, more than the 2"):
        chunked_token_losses(hidden, head, ids, chunk_size=4, num_chunks=2)


def test_chunked_loss_is_refused_for_a_model_it_cannot_reproduce():
    import pytest
    from transformers import AutoConfig

    from toolkit.errors import ConfigError
    from toolkit.models.loading import check_chunked_loss

    with pytest.raises(ConfigError, match="loss_chunk_size: a gemma2 model"):
        check_chunked_loss(AutoConfig.for_model("gemma2"))


def test_chunked_evaluation_gives_the_row_sums_of_the_full_logits_and_never_builds_them():
    """A run that fits only thanks to ``loss_chunk_size`` must fit its evaluation too: ``eval_rows`` with the chunked
    loss gives the per-row sums and target counts of the logits path (fp32), and the head only ever sees a chunk of
    positions (inside one fused ``F.linear_cross_entropy`` call that returns per-position losses), never the eval
    batch's [rows, seq, vocab]. The eval batch (4 x 16) holds more positions than a training
    micro-batch (2 x 16): in eval mode the chunk count follows the eval batch."""
    from toolkit.data.loading import CausalLMCollator
    from toolkit.models.loading import enable_chunked_loss
    from toolkit.tasks.lm import CausalLM

    plain = _tiny_gpt2().eval()
    chunked = copy.deepcopy(plain)
    enable_chunked_loss(chunked, 7, max_positions=2 * 16, max_eval_positions=4 * 16)
    rows = [{"input_ids": torch.randint(0, 97, (n,)).tolist()} for n in (16, 5, 11, 16)]
    batch = CausalLMCollator(pad_token_id=0)([{**r, "labels": r["input_ids"]} for r in rows])
    shapes = {}
    for name, model in (("plain", plain), ("chunked", chunked)):
        model.get_output_embeddings().register_forward_hook(
            lambda module, args, out, name=name: shapes.setdefault(name, []).append(tuple(out.shape)))

    task = CausalLM()
    with torch.no_grad():
        want, want_targets = task.eval_rows(plain, batch)
        got, got_targets = task.eval_rows(chunked, batch, chunked=True)
    assert torch.allclose(got, want, rtol=1e-6, atol=0) and torch.equal(got_targets, want_targets)
    assert shapes["plain"] == [(4, 16, 97)]  # what the hook sees of the whole batch's logits
    # one fused call (F.linear_cross_entropy in chunks of 7 inside it): 64 per-position losses, no logits out
    assert shapes["chunked"] == [(64,)], shapes["chunked"]


def test_a_run_with_loss_chunk_size_evaluates_in_chunks_too(tiny_model, padded_data, tmp_path):
    """train() in this process, with the chunked loss: its evaluation calls the head fused only (an eval batch of
    16 rows x up to 64 positions x GPT-2's 50257 would be 206 MB of logits), and its eval loss and tokens are the plain
    run's (learning rate 0: both evaluate the same weights)."""
    from helpers import train_in_process

    from toolkit.reporting.metrics import read_metrics

    shapes = []

    class HeadShapes:
        def on_prepared(self, accelerator, model, optimizer):
            model.get_output_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(out.shape)))

    values = {"model_name_or_path": tiny_model, **padded_data, "block_size": 64, "packing": False,
              "per_device_train_batch_size": 4, "per_device_eval_batch_size": 16, "max_steps": 1, "learning_rate": 0.0,
              "report_to": "none", "save_final_model": False}
    train_in_process({**values, "loss_chunk_size": 32, "output_dir": str(tmp_path / "chunked")},
                     callbacks=[HeadShapes()])
    assert shapes and all(len(s) == 1 for s in shapes), sorted(set(shapes))  # per-position losses, never logits
    train_in_process({**values, "output_dir": str(tmp_path / "plain")})
    chunked, plain = (read_metrics(str(tmp_path / run))[-1] for run in ("chunked", "plain"))
    assert chunked["step"] == plain["step"] == 1 and chunked["eval_tokens"] == plain["eval_tokens"]
    assert chunked["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-6)


def _task_batch(task_name: str, g: torch.Generator) -> tuple:
    """A micro-batch of each task that computes token log-probs, on the tiny GPT-2's 97 tokens: the causal LM padded
    and packed (flattened rows, per-document positions), chat SFT (the prompt masked), DPO (pairs: chosen rows, then
    rejected rows, with precomputed reference log-probs)."""
    from toolkit.data.loading import CausalLMCollator
    from toolkit.data.packing import SEQ_LENGTHS, collate_packed
    from toolkit.loss import IGNORE_INDEX
    from toolkit.tasks.dpo import DPO, REF_COLUMNS
    from toolkit.tasks.lm import CausalLM
    from toolkit.tasks.sft import ChatSFT

    def ids(n):
        return torch.randint(0, 97, (n,), generator=g).tolist()

    if task_name == "lm_packed":
        rows = [{"input_ids": ids(11) + ids(9), SEQ_LENGTHS: [11, 9]}, {"input_ids": ids(14), SEQ_LENGTHS: [14]}]
        return CausalLM(), collate_packed(rows)
    rows = [{"input_ids": ids(n)} for n in (16, 5, 11, 16)]
    if task_name in ("sft", "dpo"):  # the first 4 tokens a prompt: no target
        rows = [{**r, "labels": [IGNORE_INDEX] * 4 + r["input_ids"][4:]} for r in rows]
    batch = CausalLMCollator(pad_token_id=0)([{"labels": r["input_ids"], **r} for r in rows])
    if task_name != "dpo":
        return (ChatSFT() if task_name == "sft" else CausalLM()), batch
    batch[REF_COLUMNS[0]], batch[REF_COLUMNS[1]] = -torch.rand(2, generator=g) * 30, -torch.rand(2, generator=g) * 30
    return DPO(), batch


@pytest.mark.parametrize("task_name", ["lm", "lm_packed", "sft", "dpo"])
def test_the_fused_loss_trains_each_task_like_the_materialised_logits(task_name):
    """``loss_chunk_size`` now runs torch's ``F.linear_cross_entropy`` in chunks (toolkit.loss._fused_cross_entropy):
    3 SGD steps of each task's summed row losses, divided by the micro-batch's targets as the loop does, end within
    1e-6 of the same steps on the materialised logits, losses within 1e-6 relative. The head is really fused: it is
    called once per forward, on every position at once, and never returns logits."""
    from toolkit.models.loading import enable_chunked_loss

    plain = _tiny_gpt2().train()  # the tiny GPT-2's dropout is 0.1: off, so that both sides see the same forward
    for m in plain.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    fused = copy.deepcopy(plain)
    task, batch = _task_batch(task_name, torch.Generator().manual_seed(3))
    enable_chunked_loss(fused, 7, max_positions=batch["input_ids"].numel())
    outputs = []
    fused.get_output_embeddings().register_forward_hook(lambda m, args, out: outputs.append(out.shape))
    losses = {}
    for name, model in (("plain", plain), ("fused", fused)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(3):
            optimizer.zero_grad()
            loss = task.row_losses(model, batch, chunked=name == "fused").sum() / task.count_targets(batch)
            loss.backward()
            optimizer.step()
            losses.setdefault(name, []).append(float(loss.detach()))
    assert losses["fused"] == pytest.approx(losses["plain"], rel=1e-6, abs=0)
    for (n, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert float((p - q).abs().max()) <= 1e-6, n
    positions = batch["input_ids"].numel()
    assert outputs == [torch.Size([positions])] * 3, outputs  # one fused call a step: per-position losses, no logits


def test_under_bf16_autocast_the_fused_loss_keeps_fp32_logits_where_the_materialised_path_rounds_them():
    """Why loss_chunk_size is not bitwise the materialised loss under bf16 mixed precision (docs/performance.md#the-
    loss-without-logits): F.linear_cross_entropy is not an autocast op, so it projects the fp32 hidden states (what a
    Llama's final norm returns under autocast) with the fp32 head weight, while the materialised path's head runs
    under autocast and rounds its logits to bf16 before the fp32 cross-entropy. The fused loss is the fp32 one."""
    from toolkit.loss import chunked_token_losses

    torch.manual_seed(0)
    head = torch.nn.Linear(32, 2048, bias=False)
    hidden, labels = torch.randn(2, 24, 32), torch.randint(0, 2048, (2, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = chunked_token_losses(hidden, head, labels, 16, fused=True)[0]
        materialised = token_losses(head(hidden), labels)[0]
    fp32 = token_losses(head(hidden), labels)[0]
    assert (fused - fp32).abs().max() < 1e-4 < (materialised - fp32).abs().max()


def _peak_mib(fn) -> float:
    """The most CPU memory the tensors allocated during ``fn()`` held at once (MiB): torch's profiler's allocation
    and free events, summed in time order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


def test_grpos_fused_log_probs_and_chunked_entropy_hold_a_fraction_of_the_logits():
    """GRPO with ``loss_chunk_size`` (toolkit.loss.chunked_completion_logps) at SmolLM2's vocabulary (49152), a
    256-token completion, chunks of 16: the log-probs' forward and backward and the entropy metric held at most 1/4
    of the materialised fp32 logits at once (measured: 6 of 48 MiB, 1/8: the entropy's two chunk-sized buffers are
    the peak; 2048 positions: docs/performance.md#the-loss-without-logits), while the materialised path's forward
    alone (toolkit.tasks.grpo.loss.completion_logps) held twice the logits (the same measurement: it sees them).
    The values are the materialised ones; whole runs with and without: tests/unit/test_grpo.py."""
    from toolkit.loss import chunked_completion_logps
    from toolkit.tasks.grpo.loss import completion_logps

    torch.manual_seed(0)
    vocab, positions, chunk = 49152, 256, 16
    head = torch.nn.Linear(16, vocab, bias=False)
    hidden = torch.randn(positions, 16, requires_grad=True)
    targets = torch.randint(0, vocab, (positions,))
    logits_mib = positions * vocab * 4 / 2**20
    out = {}

    def chunked_step():
        logps, entropy = chunked_completion_logps(hidden, head, targets, chunk)
        logps.sum().backward()
        out["chunked"] = (logps.detach(), entropy)

    def materialised_forward():
        with torch.no_grad():
            out["materialised"] = completion_logps(head(hidden), targets, 1.0)

    peak = _peak_mib(chunked_step)
    assert peak <= logits_mib / 4, (peak, logits_mib)
    assert _peak_mib(materialised_forward) >= 2 * logits_mib  # its forward alone: the logits and their log-softmax
    assert torch.allclose(out["chunked"][0], out["materialised"][0], rtol=1e-6, atol=0)
    assert torch.allclose(out["chunked"][1], out["materialised"][1], rtol=1e-6, atol=0)


def test_grpos_log_probs_through_a_head_that_cannot_be_fused_take_the_checkpointed_chunks():
    """A head that is not a plain ``nn.Linear`` (LoRA on lm_head; here a subclass, which ``can_fuse`` refuses the
    same way): GRPO's log-probs and entropies from the checkpointed chunks, every chunk's logits computed by calling
    the head (each call a chunk, none more), the count the caller asks for (ZeRO-3: the same on every rank, the
    chunks past the data empty); values and gradients those of the materialised logits, temperature 0.7."""
    from toolkit.loss import chunked_completion_logps
    from toolkit.tasks.grpo.loss import completion_logps

    class Head(torch.nn.Linear):
        pass

    torch.manual_seed(0)
    head = Head(8, 97, bias=True)
    hidden, targets = torch.randn(22, 8, requires_grad=True), torch.randint(0, 97, (22,))
    calls = []
    head.register_forward_hook(lambda m, args, out: calls.append(tuple(out.shape)))
    logps, entropy = chunked_completion_logps(hidden, head, targets, 5, 0.7, num_chunks=6)  # 22: 5 chunks of data
    assert calls == [(5, 97)] * 4 + [(2, 97), (0, 97)], calls
    logps.sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    want_logps, want_entropy = completion_logps(head(hidden), targets, 0.7)
    want_logps.sum().backward()
    assert torch.allclose(logps, want_logps, rtol=1e-6, atol=0) and torch.allclose(entropy, want_entropy, rtol=1e-6)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-6) and torch.allclose(grads[1], head.weight.grad, atol=1e-6)
    with pytest.raises(ValueError, match="22 completion positions need 5 chunks of 5, more than the 4"):
        chunked_completion_logps(hidden, head, targets, 5, 0.7, num_chunks=4)
