"""Muon's fields (``optim: muon``) and their checks, a part of ``toolkit.config``'s ``TrainingArguments``; the
optimizer itself is ``toolkit.training.optimizers``'s.

The names are torch.optim.Muon's arguments with a ``muon_`` prefix, and the defaults are torch 2.13's (the test
suite checks them against torch: tests/unit/test_optimizers.py). ``learning_rate`` and ``weight_decay`` are the
Muon group's, as they are torch's Muon's ``lr`` and ``weight_decay``. Standard library only: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from toolkit.config.checks import _at_least_zero, _finite, _fraction, _one_of, _positive
from toolkit.errors import ConfigError

# torch.optim._muon's DEFAULT_A, DEFAULT_B, DEFAULT_C (Keller Jordan's quintic), EPS and DEFAULT_NS_STEPS
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_STEPS = 5
ADJUST_LR_FNS = ("original", "match_rms_adamw")  # torch's; its None is "original"
NS_DTYPES = ("bfloat16", "float32")
# Keller Jordan's MuonWithAuxAdam example (and DeepSpeed's, which copies it): Muon at 0.02, the AdamW group at 3e-4
ADAMW_LEARNING_RATE = 3e-4


@dataclass
class MuonArguments:
    """A part of ``TrainingArguments``: its fields come after that class's own (in --help and config.yaml)."""

    muon_momentum: float = field(default=0.95, metadata={"help": "optim muon: the momentum (torch.optim.Muon's "
                                                                 "momentum)."})
    muon_nesterov: bool = field(default=True, metadata={"help": "optim muon: Nesterov momentum (torch's nesterov)."})
    muon_ns_steps: int = field(default=NS_STEPS, metadata={"help": "optim muon: Newton-Schulz iterations (torch's "
                                                                   "ns_steps)."})
    muon_ns_coefficients: list[float] = field(
        default_factory=lambda: list(NS_COEFFICIENTS),
        metadata={"help": "optim muon: the quintic's a b c (torch's ns_coefficients; default Keller Jordan's)."})
    muon_eps: float = field(default=NS_EPS, metadata={"help": "optim muon: the floor of the norm the update is "
                                                              "divided by before the iterations (torch's eps)."})
    muon_adjust_lr_fn: str = field(
        default="original", metadata={"help": "optim muon: the learning rate's scaling by the matrix's shape (torch's "
                                              "adjust_lr_fn): original (Keller Jordan's, sqrt(max(1, rows/cols))) or "
                                              "match_rms_adamw (Moonlight's, 0.2 sqrt(max(rows, cols)): the update's "
                                              "RMS of AdamW's, so AdamW's learning rate and weight decay carry over)."})
    muon_ns_dtype: str = field(
        default="bfloat16", metadata={"help": "optim muon: the dtype of the Newton-Schulz iterations: bfloat16 "
                                              "(torch's) or float32 (exact: the same result under every split and "
                                              "strategy; bfloat16's differs in the last bits, docs/pitfalls.md"
                                              "#muon-bf16)."})
    muon_adamw_learning_rate: float = field(
        default=ADAMW_LEARNING_RATE,
        metadata={"help": "optim muon: the peak learning rate of the AdamW group (embeddings, output head, norms, "
                          "biases; learning_rate is the Muon group's). Default 3e-4, Keller Jordan's recipe beside "
                          "Muon's 0.02; with muon_adjust_lr_fn match_rms_adamw set it to learning_rate (Moonlight's)."})

    def _check_muon(self) -> None:
        """Muon's fields, and the combinations it does not run yet, refused before any work."""
        _positive(self, "muon_ns_steps")
        _finite(self, "muon_eps", "muon_adamw_learning_rate")
        _fraction(self, "muon_momentum", why=" (a moving average's decay)")
        _at_least_zero(self, "muon_adamw_learning_rate")
        if self.muon_ns_steps >= 100:  # torch raises only at the first step
            raise ConfigError("muon_ns_steps", f"torch's Muon takes fewer than 100 steps, got {self.muon_ns_steps}")
        if len(self.muon_ns_coefficients) != 3 or not all(map(math.isfinite, self.muon_ns_coefficients)):
            raise ConfigError("muon_ns_coefficients", f"needs exactly 3 finite values (a b c), got "
                                                      f"{self.muon_ns_coefficients}")
        if not self.muon_eps > 0:
            raise ConfigError("muon_eps", f"must be > 0 (it floors a norm that is divided by), got {self.muon_eps}")
        _one_of(self, "muon_adjust_lr_fn", ADJUST_LR_FNS)
        _one_of(self, "muon_ns_dtype", NS_DTYPES)
        if self.optim == "muon" and self.pipeline_parallel_size > 1:
            raise ConfigError("optim", "muon is not supported with pipeline_parallel_size > 1 yet: use one process, "
                                       "ddp.yaml or fsdp.yaml without a pipeline, or optim adamw_torch")
