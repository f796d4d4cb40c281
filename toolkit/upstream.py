"""What the libraries underneath make every process pay for code it never runs, avoided (docs/pitfalls.md).

transformers' modeling code imports its loss table (``transformers.loss.loss_utils``), and with it the object-detection
losses, which import ``scipy.optimize`` wherever scipy happens to be installed (for a Hungarian matcher): a part of
every process's start-up that loads a model (measured: docs/pitfalls.md#scipy-import), for a function no causal LM,
chat, classifier or DPO run calls. ``import_transformers_losses`` imports that table with a stand-in for
``scipy.optimize`` whose ``linear_sum_assignment`` imports scipy's own on its first call, and takes the stand-in out
of ``sys.modules`` again, so that any later ``import scipy.optimize`` (a detection model's own module, the user's
code) gets scipy's module. It runs when this module is imported: ``toolkit.model`` and ``toolkit.loop`` import it
before transformers.
"""

from __future__ import annotations

import sys
import types


def _linear_sum_assignment(*args, **kwargs):
    """scipy's, imported on the first call (the stand-in is out of ``sys.modules`` by then)."""
    from scipy.optimize import linear_sum_assignment

    return linear_sum_assignment(*args, **kwargs)


def import_transformers_losses() -> None:
    """Import ``transformers.loss.loss_utils`` without importing ``scipy.optimize`` (module docstring). Does nothing
    where either is imported already."""
    if "transformers.loss.loss_utils" in sys.modules or "scipy.optimize" in sys.modules:
        return
    stand_in = types.ModuleType("scipy.optimize", "toolkit.upstream's stand-in: scipy.optimize imports on first use")
    stand_in.linear_sum_assignment = _linear_sum_assignment
    sys.modules["scipy.optimize"] = stand_in
    try:
        import transformers.loss.loss_utils  # noqa: F401
    finally:
        if sys.modules.get("scipy.optimize") is stand_in:
            del sys.modules["scipy.optimize"]


import_transformers_losses()
