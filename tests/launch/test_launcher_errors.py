"""A recipe's own error under a launcher (issue 25, point 6): what the user reads and the exit codes.

One real launch serves both tests: ``python -m toolkit verify`` under ``ddp.yaml`` with 2 processes, pointed at a
model folder that does not exist, with a recipe of the user's own (a copy of recipes/gpt2.py: verify checks a shipped
recipe's launch before it launches, as ``toolkit train`` does, and would refuse this in a second; a script of one's
own meets it in its ranks). Its first run is ``accelerate launch --quiet ... --num_processes 2 my_recipe.py ...``
(2 gloo ranks); both ranks stop with the same ``config error: model_name_or_path: cannot load ...``. The launch's
whole output is verify's log of that run: the user's view of ``accelerate launch -q``.
The exit codes under each launcher: docs/reliability.md#exit-codes.
"""

import os
import shutil
import sys

import pytest
from helpers import CONFIGS, ROOT, args_from, run


@pytest.fixture(scope="module")
def failed_verify(tmp_path_factory, padded_data):
    work = tmp_path_factory.mktemp("verify_missing_model")
    # Relative, like the README's outputs/models/tiny-gpt2 when its step (python -m toolkit offline) was not taken:
    # not unmistakably a path (only /, ./, ../ and ~ are checked when the config is parsed), so the ranks meet it.
    missing = "outputs/models/never-written"
    recipe_args = args_from({"model_name_or_path": missing, **padded_data, "block_size": 32, "packing": False,
                             "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2})
    recipe = work / "my_recipe.py"
    shutil.copy(os.path.join(ROOT, "recipes", "gpt2.py"), recipe)
    proc = run([sys.executable, "-m", "toolkit", "verify", "--config_file", os.path.join(CONFIGS, "ddp.yaml"),
                "--num_processes", "2", "--checks", "sgd", "--work_dir", str(work / "verify"), "--recipe", str(recipe),
                *recipe_args], check=False)
    with open(work / "verify" / "sgd-strategy.log") as f:
        return {"proc": proc, "missing": missing, "log": f.read(), "log_path": str(work / "verify" / "sgd-strategy.log")}


@pytest.mark.slow  # a 2-rank launch: the full suite's layer
def test_config_error_under_accelerate_launch_prints_once_without_the_launchers_traceback(failed_verify):
    """Both ranks meet the error; its line is on the output once, whole (two ranks once glued theirs into one line),
    with no traceback; each rank exits 2, which the launcher reports, and the launcher itself exits 1."""
    log, missing = failed_verify["log"], failed_verify["missing"]
    lines = [line for line in log.splitlines() if "config error:" in line]
    assert len(lines) == 1, log[-3000:]
    assert lines[0].startswith(f"config error: model_name_or_path: cannot load '{missing}'"), lines
    assert "Traceback" not in log, log[-3000:]
    assert "(exitcode: 2)" in log  # torch elastic's line for the first rank to exit
    assert "  sgd strategy: exit 1 in " in failed_verify["proc"].stdout  # the launcher's own code


@pytest.mark.slow
def test_verify_prints_the_recipes_own_error_and_the_log(failed_verify):
    """verify used to print the last 40 lines of the log: the launcher's traceback, with the cause above them."""
    proc, missing = failed_verify["proc"], failed_verify["missing"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = proc.stderr.splitlines()
    assert errors[0].startswith(f"config error: model_name_or_path: cannot load '{missing}'"), proc.stderr
    assert errors[1] == f"(the run's whole output: {failed_verify['log_path']})"
    assert len(errors) == 2 and "Traceback" not in proc.stdout + proc.stderr
