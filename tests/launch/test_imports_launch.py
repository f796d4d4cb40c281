"""Parsing a config in a fresh interpreter (a subprocess) imports neither torch nor accelerate. The import graph
itself, read from the source with ``ast``, is checked in tests/unit/test_imports.py."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import subprocess_env


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
