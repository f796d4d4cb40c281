"""Parsing a config in a fresh interpreter (a subprocess) imports neither torch nor accelerate; a run's imports load
transformers' modeling code without scipy.optimize, and its schedulers' peft without bitsandbytes (toolkit.env.upstream).
The import graph itself, read from the source with ``ast``, is checked in tests/unit/test_imports.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from helpers import run_all, subprocess_env


def test_parsing_a_config_imports_neither_torch_nor_accelerate(tmp_path):
    """The real import, in a fresh interpreter. Measured (transformers 5.24): importing toolkit.config loads no
    transformers at all; config_from_dict loads transformers' HfArgumentParser, which does not pull in torch or
    accelerate. A Hub-like model id is not a folder, so no model config is read."""
    code = (
        "import json, sys\n"
        "import toolkit.config\n"
        "after_import = sorted(m for m in ('torch', 'accelerate', 'transformers') if m in sys.modules)\n"
        "cfg = toolkit.config.config_from_dict(dict(model_name_or_path='gpt2', dataset_name='pydoc',\n"
        f"                                          output_dir={str(tmp_path / 'run')!r}))\n"
        "print(json.dumps({'after_import': after_import, 'model': cfg.model.model_name_or_path,\n"
        "                  'loaded': sorted(m for m in ('torch', 'accelerate') if m in sys.modules)}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["model"] == "gpt2"  # the config was really parsed
    assert result["after_import"] == []
    assert result["loaded"] == [], f"parsing a config imported {result['loaded']}"


# What a process knows of transformers.models after importing it: how many folders transformers scanned for their
# __all__ before and after (the cached scan's misses), and a digest of the lazy import table the scan built.
_SCANS = (
    "import hashlib, json, sys\n"
    "from transformers.utils import import_utils\n"
    "scan = import_utils.create_import_structure_from_path\n"
    "scan = getattr(scan, '__toolkit__', scan)\n"
    "first = scan.cache_info().misses\n"
    "from transformers import AutoConfig\n"
    "table = sys.modules['transformers.models']\n"
    "missing = {k: sorted(v) for k, v in table._object_missing_backend.items()}\n"
    "digest = hashlib.sha256(repr((sorted(table._modules), sorted(table._class_to_module.items()),\n"
    "                              sorted(missing.items()))).encode()).hexdigest()\n"
    "print(json.dumps({'first': first, 'again': scan.cache_info().misses - first, 'digest': digest,\n"
    "                  'config': AutoConfig.for_model('gpt2').model_type}))\n"
)


def test_transformers_reads_its_model_files_once_a_process():
    """``import transformers`` scans the folders of ``transformers.models`` (1,677 files opened for their ``__all__``),
    and the first import of ``transformers.models`` scans them all again from another path (about 0.25 s of every
    process's start-up: docs/pitfalls.md#transformers-import-scan): the plain import shows it. Through a config parse
    (a rank's first step, ``toolkit.env.upstream.import_transformers``) the second import reads the first scan: the same
    import table, a few folders read again instead of every one."""
    plain = "import transformers\n" + _SCANS
    ours = ("import toolkit.config\n"
            "toolkit.config.config_from_dict(dict(model_name_or_path='gpt2', dataset_name='pydoc', output_dir='run'))\n"
            + _SCANS)
    env = {**subprocess_env(), "PYTHONHASHSEED": "0"}  # the table's lists of missing backends come from sets
    results = []
    for proc in run_all([[sys.executable, "-c", plain], [sys.executable, "-c", ours]], envs=[env, env]):
        assert proc.returncode == 0, proc.stderr[-4000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    plain, ours = results
    assert plain["first"] > 100 and plain["again"] >= plain["first"] - 5  # the upstream cost: everything again
    assert ours["first"] == plain["first"] and ours["again"] < 5, ours
    assert ours["digest"] == plain["digest"] and ours["config"] == "gpt2"


@pytest.fixture(scope="module")
def imports() -> list[dict]:
    """What a plain import of transformers loads, and what a rank's imports load (toolkit.training.build, toolkit.training.loop, a model
    class, the schedulers as toolkit.training.loop imports them, peft): two fresh interpreters, run side by side."""
    pytest.importorskip("scipy")  # the cost exists only where scipy is installed
    plain = (
        "import json, sys\n"
        "import transformers.modeling_utils\n"
        "modeling = 'transformers.modeling_utils' in sys.modules\n"
        "print(json.dumps({'scipy.optimize': 'scipy.optimize' in sys.modules, 'modeling': modeling}))\n"
    )
    ours = (
        "import json, sys\n"
        "import toolkit.training.build, toolkit.training.loop\n"
        "from toolkit.env import upstream\n"
        "from transformers import AutoModelForCausalLM\n"
        "upstream.import_peft()\n"
        "from transformers import get_scheduler\n"
        "import peft, transformers.modeling_utils\n"
        "loaded = 'scipy.optimize' in sys.modules\n"
        "bnb = 'bitsandbytes' in sys.modules\n"
        "from transformers.loss.loss_for_object_detection import linear_sum_assignment\n"
        "rows, cols = linear_sum_assignment([[4, 1, 3], [2, 0, 5], [3, 2, 2]])\n"
        "print(json.dumps({'scipy.optimize': loaded, 'modeling': 'transformers.modeling_utils' in sys.modules,\n"
        "                  'cols': cols.tolist(), 'real_after_call': sys.modules['scipy.optimize'].__file__ is not None,\n"
        "                  'bitsandbytes': bnb, 'peft': 'peft' in sys.modules}))\n"
    )
    procs = run_all([[sys.executable, "-c", plain], [sys.executable, "-c", ours]])
    results = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


def test_a_runs_imports_leave_scipy_optimize_out_until_a_matcher_is_called(imports):
    """transformers' modeling code imports its object-detection losses, which import scipy.optimize wherever scipy is
    installed (0.5 s a process here: docs/pitfalls.md#scipy-import): the plain import shows it. After what a
    rank imports (toolkit.training.build, toolkit.training.loop, a model class, the schedulers, peft) it is not loaded, and transformers'
    matcher still gives scipy's answer, importing scipy's own module when called."""
    plain, ours = imports
    assert plain["scipy.optimize"] and plain["modeling"]  # the upstream cost, without toolkit
    assert ours["modeling"] and not ours["scipy.optimize"]
    assert ours["cols"] == [1, 0, 2] and ours["real_after_call"]  # scipy's optimal assignment


def test_a_runs_schedulers_import_peft_without_bitsandbytes_until_it_is_used(imports):
    """transformers' schedulers import peft, and peft bitsandbytes wherever it is installed (with torch's compiler:
    docs/pitfalls.md#bitsandbytes-import; not shown here: it costs a process 3 s). After what a rank imports, peft is
    loaded but bitsandbytes is not (that the stand-in peft holds reaches the real module on first use: tests/unit/test_imports.py).
    """
    if importlib.util.find_spec("bitsandbytes") is None:  # (not importorskip: it would import it, 2-3 s)
        pytest.skip("the cost exists only where bitsandbytes is installed")
    ours = imports[1]
    assert ours["peft"] and not ours["bitsandbytes"]
