"""``optim: muon``: torch's ``torch.optim.Muon`` on the hidden weight matrices, torch's AdamW on the rest, as one
optimizer (what accelerate, the scheduler and the checkpoints hold).

The split (``muon_split``), printed once at the start with each group's parameter count:
  Muon   every trainable 2-D weight, except those of embedding modules (``nn.Embedding``: tokens, positions) and of
         the output head (``get_output_embeddings()``, tied or not);
  AdamW  those, and every parameter that is not 2-D (norms, biases), with ``muon_adamw_learning_rate``, the usual
         ``adam_*`` fields, and ``weight_decay`` on its 2-D weights only.
That is Keller Jordan's and Moonlight's rule: Muon orthogonalises a matrix's update, which suits a linear map between
hidden states, not a lookup table (an embedding's rows are updated one token at a time) or the logits' scale.
A model without an output head transformers can name is refused (its classifier would get Muon).

The Newton-Schulz iterations: torch runs them in bfloat16 (``_zeropower_via_newtonschulz`` starts with
``grad.bfloat16()``), which makes the update depend on how the gradient was summed in its last bits: another split
of the same global batch (accumulation, ranks, FSDP's shards) ends 1e-4 to 1e-2 away after a few steps
(docs/pitfalls.md#muon-bf16). ``NewtonSchulzDtype`` runs torch's own function with that one cast made to the dtype
asked for, by a ``TorchFunctionMode`` around torch's ``Muon.step`` that answers ``Tensor.bfloat16`` (the only call
of it in torch's step) with a copy in that dtype: nothing of torch's algorithm is copied here, so a later torch's
Muon is what runs (tests/unit/test_optimizers.py checks it against torch's bits and a float64 reference). With
``float32`` the update is the same under every split to fp32 rounding (DDP, FSDP2, HSDP and TP against one process
to 3e-7: tests/launch/test_muon.py). It also fixes torch's aliasing for bf16 weights: there ``buf.bfloat16()``
returns the momentum buffer itself (nesterov false), which the iterations' first ``div_`` then normalises in place;
the mode always hands them a copy.

Under FSDP2, HSDP and TP the Muon matrices are DTensor shards: each one's iterations run once, on an owner rank that
gathers it whole and scatters the result (``toolkit.training.newton_schulz``: torch's own function on the whole
matrix, as one process runs it), the cheapest of the ways measured (docs/performance.md#muons-optimizer-step).
"""

from __future__ import annotations

import torch

from toolkit.config import TrainingArguments
from toolkit.errors import ConfigError
from toolkit.training.newton_schulz import NewtonSchulzDtype, owner_layout, owner_muon_step

__all__ = ["NewtonSchulzDtype", "MuonWithAdamW", "build_muon", "muon_split", "saved_muon_names"]

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over a Muon group and AdamW groups (each group's ``use_muon`` says which): the param groups and
    the state are this object's, as for any torch optimizer (so ``state_dict``, the scheduler, accelerate's FSDP2
    parameter swap and torch.distributed.checkpoint see one optimizer); ``step`` hands each inner torch optimizer
    its groups and this state, then runs it. ``split``: the rule's line, printed once."""

    def __init__(self, muon_params: list, adamw_groups: list[dict], *, ns_dtype: torch.dtype, muon: dict,
                 adamw: dict, split: str = "", sharded: str = "owner"):
        self.inner = {}
        if muon_params:
            self.inner[True] = torch.optim.Muon(muon_params, **muon)
        if any(g["params"] for g in adamw_groups):
            self.inner[False] = torch.optim.AdamW([g for g in adamw_groups if g["params"]], **adamw)
        for use_muon, optimizer in self.inner.items():
            for group in optimizer.param_groups:
                group["use_muon"] = use_muon
        super().__init__([g for _, o in sorted(self.inner.items(), reverse=True) for g in o.param_groups], {})
        self.ns_dtype, self.split, self.sharded = ns_dtype, split, sharded

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # load_state_dict replaces this object's groups and state: the inner optimizers read them afresh each step
        for use_muon, optimizer in self.inner.items():
            optimizer.param_groups = [g for g in self.param_groups if g["use_muon"] is use_muon]
            optimizer.state = self.state
        if True in self.inner:
            self._muon_step()
        if False in self.inner:
            self.inner[False].step()
        return loss

    def _muon_step(self) -> None:
        """torch's Muon on plain tensors (one process, DDP) and on DTensors of other layouts; the sharded matrices
        by the owner scheme (``toolkit.training.newton_schulz``) unless ``sharded`` is "dtensor" (torch's path)."""
        muon = self.inner[True]
        groups, owned = [], []
        for group in muon.param_groups:
            mine = [p for p in group["params"] if p.grad is not None and self.sharded == "owner"
                    and owner_layout(p) is not None]
            owned.append((group, mine))
            groups.append({**group, "params": [p for p in group["params"] if not any(p is q for q in mine)]})
        # how many matrices each path iterated on in this step (what the tests read of a launched run)
        self.newton_schulz = {"owner": sum(len(m) for _, m in owned),
                              "torch": sum(p.grad is not None for g in groups for p in g["params"])}
        muon.param_groups = groups
        with NewtonSchulzDtype(self.ns_dtype):
            muon.step()
        for group, mine in owned:
            if mine:
                owner_muon_step(group, mine, self.state, self.ns_dtype)


def muon_split(model: torch.nn.Module) -> tuple[list, list, list]:
    """(Muon's, AdamW's 2-D, AdamW's others) trainable ``(name, parameter)`` pairs, each in the model's order (a tied
    weight once, under its first name): the rule of the module docstring."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ConfigError("optim", f"muon needs a model with an output head transformers names "
                                   f"(get_output_embeddings: a causal LM); {type(model).__name__} has none, and its "
                                   "classifier would get Muon: use optim adamw_torch")
    table = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    table |= {id(p) for p in head.parameters()}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [(n, p) for n, p in named if p.ndim == 2 and id(p) not in table]
    adamw_2d = [(n, p) for n, p in named if p.ndim == 2 and id(p) in table]
    others = [(n, p) for n, p in named if p.ndim != 2]
    return muon, adamw_2d, others


def saved_muon_names(folder: str) -> set[str]:
    """The Muon group's parameter names of the causal LM saved in ``folder`` (an export: its config.json), by
    ``muon_split`` on the model built on the meta device (no weights read): what equality checks compare at Muon's
    tolerance (toolkit verify, the capability matrix)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return {n for n, _ in muon_split(model)[0]}


def build_muon(model: torch.nn.Module, args: TrainingArguments) -> MuonWithAdamW:
    """``optim: muon``'s optimizer from the config's fields (``toolkit.config.muon``)."""
    muon, adamw_2d, others = muon_split(model)

    def count(pairs):
        return f"{sum(p.numel() for _, p in pairs):,} parameters in {len(pairs)} tensors"

    split = (f"optim muon: Muon on the hidden 2-D weights ({count(muon)}; Newton-Schulz in {args.muon_ns_dtype}); "
             f"AdamW on embeddings, output head, norms and biases ({count(adamw_2d + others)}, lr "
             f"{args.muon_adamw_learning_rate})")
    return MuonWithAdamW(
        [p for _, p in muon],
        [{"params": [p for _, p in adamw_2d], "weight_decay": args.weight_decay},
         {"params": [p for _, p in others], "weight_decay": 0.0}],
        ns_dtype=NS_DTYPES[args.muon_ns_dtype],
        muon=dict(lr=args.learning_rate, weight_decay=args.weight_decay, momentum=args.muon_momentum,
                  nesterov=args.muon_nesterov, ns_coefficients=tuple(args.muon_ns_coefficients), eps=args.muon_eps,
                  ns_steps=args.muon_ns_steps, adjust_lr_fn=args.muon_adjust_lr_fn),
        adamw=dict(lr=args.muon_adamw_learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                   eps=args.adam_epsilon),
        split=split,
    )
