"""Quantization's fields (bitsandbytes: a frozen base in 4 or 8 bits, QLoRA) and their checks, a part of
``toolkit.config``'s ``ModelArguments``; loading and storing the quantized base is ``toolkit.models.quantization``'s.

Standard library only (``importlib.util.find_spec`` asks whether bitsandbytes is installed, without importing it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from toolkit.config.checks import _one_of
from toolkit.errors import ConfigError

BNB_4BIT_QUANT_TYPES = ("nf4", "fp4")


@dataclass
class QuantizationArguments:
    """A part of ``ModelArguments``: its fields come after that class's own (in --help and config.yaml)."""

    # bitsandbytes quantization of the frozen base (QLoRA), TRL's names (ModelConfig); toolkit.models.quantization
    load_in_4bit: bool = field(default=False, metadata={"help": "Load the base in 4 bits (QLoRA; needs use_peft: true "
                                                                "and pip install '.[qlora]'). Compute in torch_dtype."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Load the base in 8 bits (LLM.int8; needs use_peft: "
                                                                "true and pip install '.[qlora]')."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "With load_in_4bit: nf4 (NormalFloat, QLoRA's) "
                                                                      "or fp4."})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "With load_in_4bit: quantize the quantization "
                                                                        "constants too (double quantization: about "
                                                                        "0.37 bits less a weight)."})

    def _check_quantization(self) -> None:
        """A quantized base is frozen (only adapters train on it) and needs bitsandbytes: refused here, at once."""
        _one_of(self, "bnb_4bit_quant_type", BNB_4BIT_QUANT_TYPES)
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("load_in_8bit", "choose one of load_in_4bit and load_in_8bit")
        name = "load_in_4bit" if self.load_in_4bit else "load_in_8bit" if self.load_in_8bit else None
        if name and not self.use_peft:
            raise ConfigError(name, "a quantized base cannot be trained, only adapters on it: set use_peft: true")
        if name and importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(name, "needs bitsandbytes: pip install '.[qlora]' (or set it false)")
