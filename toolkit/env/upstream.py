"""What the libraries underneath make every process pay for code it never runs, avoided (docs/pitfalls.md).

transformers' modeling code imports its loss table (``transformers.loss.loss_utils``), and with it the object-detection
losses, which import ``scipy.optimize`` wherever scipy happens to be installed (for a Hungarian matcher): a part of
every process's start-up that loads a model (measured: docs/pitfalls.md#scipy-import), for a function no causal LM,
chat, classifier or DPO run calls. ``import_transformers_losses`` imports that table with a stand-in for
``scipy.optimize`` whose ``linear_sum_assignment`` imports scipy's own on its first call, and takes the stand-in out
of ``sys.modules`` again, so that any later ``import scipy.optimize`` (a detection model's own module, the user's
code) gets scipy's module. ``toolkit.models.loading`` and ``toolkit.training.loop`` call it once their own imports are done, before
transformers' modeling code loads. (Importing this module imports nothing: ``toolkit.config.parsing`` imports it to
parse a config, which loads neither torch nor a model.)

Likewise transformers' schedulers (``get_scheduler``: ``transformers.optimization`` imports ``trainer_utils``) import
peft wherever it is installed, peft imports bitsandbytes wherever that is installed (``peft.helpers``, for a function
that dequantizes a 4-bit weight), and bitsandbytes imports torch's compiler (``torch._inductor``): 2.3 s of a rank's
start-up for a run with no quantized layer. ``import_peft`` imports peft with a stand-in for bitsandbytes whose
attributes import the real one on first use, and takes the stand-in out of ``sys.modules`` again; ``toolkit.training.loop``
calls it before it imports the scheduler.

And transformers reads its model files twice in every process: ``import transformers`` builds the lazy import table of
``transformers.models`` by opening each of its 1,677 files for their ``__all__`` (``define_import_structure`` on the
folder), and the first import of ``transformers.models`` (``AutoConfig``, ``AutoTokenizer``: every run) builds the same
table again from ``models/__init__.py``, a path the cache (keyed by the argument) has not seen: about 0.25 s of
every process's start-up. ``import_transformers`` imports transformers and has the second build find the first's scan
(the folder of a file is the folder itself, as the scan already takes it); ``toolkit.config.parsing`` calls it before
it parses a recipe's arguments, the first thing a run does.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path


def import_transformers() -> None:
    """Import transformers; ``transformers.models``' import table then reuses the scan ``import transformers`` made of
    the same folder (module docstring). Does nothing more where ``transformers.models`` is imported already, or where
    transformers no longer has the cached scan this relies on."""
    import transformers  # noqa: F401
    from transformers.utils import import_utils

    scan = getattr(import_utils, "create_import_structure_from_path", None)
    if "transformers.models" in sys.modules or not hasattr(scan, "cache_info") or hasattr(scan, "__toolkit__"):
        return

    def scan_of_the_folder(module_path):
        # transformers/__init__.py scanned Path(.../models); models/__init__.py passes its own file: the same folder
        if os.path.isfile(module_path):
            module_path = Path(os.path.dirname(module_path))
        return scan(module_path)

    scan_of_the_folder.__toolkit__ = scan  # the original, and a mark that it is installed once
    import_utils.create_import_structure_from_path = scan_of_the_folder


def _linear_sum_assignment(*args, **kwargs):
    """scipy's, imported on the first call (the stand-in is out of ``sys.modules`` by then)."""
    from scipy.optimize import linear_sum_assignment

    return linear_sum_assignment(*args, **kwargs)


def import_transformers_losses() -> None:
    """Import ``transformers.loss.loss_utils`` without importing ``scipy.optimize`` (module docstring). Does nothing
    where either is imported already."""
    if "transformers.loss.loss_utils" in sys.modules or "scipy.optimize" in sys.modules:
        return
    stand_in = types.ModuleType("scipy.optimize", "toolkit.env.upstream's stand-in: scipy.optimize imports on first use")
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
    stand_in = _DeferredModule("bitsandbytes", "toolkit.env.upstream's stand-in: bitsandbytes imports on first use")
    stand_in.__spec__ = spec  # importlib.util.find_spec("bitsandbytes") still answers while it stands in
    if spec is not None:
        sys.modules["bitsandbytes"] = stand_in
    try:
        import peft  # noqa: F401
    finally:
        if sys.modules.get("bitsandbytes") is stand_in:
            del sys.modules["bitsandbytes"]

