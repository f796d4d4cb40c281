"""Classification's data fields (the label column, class weights) and their checks, a part of ``toolkit.config``'s
``DataArguments``; labels, weights and the loss are ``toolkit.tasks.classification``'s.

Standard library only (and toolkit.errors, toolkit.config.checks): no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from toolkit.config.checks import CLASSIFICATION_ONLY
from toolkit.errors import ConfigError


@dataclass
class ClassificationArguments:
    """A part of ``DataArguments``: its fields come after that class's own (in --help and config.yaml)."""

    label_column_name: Optional[str] = field(
        default=None, metadata={"help": "Classification: the label column, class names or ids (default: 'label').",
                                "tasks": CLASSIFICATION_ONLY}
    )
    class_weights: Optional[list[str]] = field(
        default=None, metadata={"help": "Classification: one loss weight per class (in the order of the class "
                                        "names), or 'balanced' (n_rows / (n_classes x class rows), from train).",
                                "nargs": "+", "tasks": CLASSIFICATION_ONLY}
    )

    def _check_class_weights(self) -> None:
        """One positive number per class, or 'balanced' (the number of classes is known only once the data is read)."""
        if self.class_weights and self.class_weights != ["balanced"]:
            try:
                weights = [float(w) for w in self.class_weights]
            except ValueError:
                raise ConfigError("class_weights", f"expected one number per class or 'balanced', got "
                                                   f"{self.class_weights}") from None
            if any(not w > 0 for w in weights):
                raise ConfigError("class_weights", f"every weight must be > 0, got {self.class_weights}")
