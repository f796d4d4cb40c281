"""What the libraries underneath make every process pay for code it never runs, avoided (docs/pitfalls.md).

transformers' modeling code imports its loss table (``transformers.loss.loss_utils``), and with it the object-detection
losses, which import ``scipy.optimize`` wherever scipy happens to be installed (for a Hungarian matcher): a part of
every process's start-up that loads a model (measured: docs/pitfalls.md#scipy-import), for a function no causal LM,
chat, classifier or DPO run calls. ``import_transformers_losses`` imports that table with a stand-in for
``scipy.optimize`` whose ``linear_sum_assignment`` imports scipy's own on its first call, and takes the stand-in out
of ``sys.modules`` again, so that any later ``import scipy.optimize`` (a detection model's own module, the user's
code) gets scipy's module. It runs when this module is imported: ``toolkit.model`` and ``toolkit.loop`` import it
before transformers.

Likewise transformers' schedulers (``get_scheduler``: ``transformers.optimization`` imports ``trainer_utils``) import
peft wherever it is installed, peft imports bitsandbytes wherever that is installed (``peft.helpers``, for a function
that dequantizes a 4-bit weight), and bitsandbytes imports torch's compiler (``torch._inductor``): 2.3 s of a rank's
start-up for a run with no quantized layer. ``import_peft`` imports peft with a stand-in for bitsandbytes whose
attributes import the real one on first use, and takes the stand-in out of ``sys.modules`` again; ``toolkit.loop``
calls it before it imports the scheduler.
"""

from __future__ import annotations

import importlib
import importlib.util
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


class _DeferredModule(types.ModuleType):
    """A stand-in module: its first attribute read imports the real module (out of ``sys.modules`` by then)."""

    def __getattr__(self, name):
        if name.startswith("__"):  # probes of a module's machinery (__path__, __file__) do not import it
            raise AttributeError(name)
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), name)


def import_peft() -> None:
    """Import peft without importing bitsandbytes (module docstring). Does nothing where either is imported already or
    peft is not installed; where bitsandbytes is not installed, a plain import."""
    if "peft" in sys.modules or "bitsandbytes" in sys.modules or importlib.util.find_spec("peft") is None:
        return
    spec = importlib.util.find_spec("bitsandbytes")
    stand_in = _DeferredModule("bitsandbytes", "toolkit.upstream's stand-in: bitsandbytes imports on first use")
    stand_in.__spec__ = spec  # importlib.util.find_spec("bitsandbytes") still answers while it stands in
    if spec is not None:
        sys.modules["bitsandbytes"] = stand_in
    try:
        import peft  # noqa: F401
    finally:
        if sys.modules.get("bitsandbytes") is stand_in:
            del sys.modules["bitsandbytes"]


import_transformers_losses()
