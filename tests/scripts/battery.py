"""Runs the real recipe (recipes/gpt2.py, or the case's ``recipe``, through its own ``cli``) once per bad-input case,
in one process.

Usage: battery.py CASES_JSON OUT_JSON. Each case is {"name", "argv", "env", optional "recipe": "dpo", ...}; for each, the process environment gets
``env``, ``sys.argv`` is the recipe's command line, and what the recipe does is recorded: its exit code, stderr, and
whether the weights loaded (``toolkit.training.build`` logs "weights train in" right after they do). One process for every
case because each would otherwise pay ~5 s of imports; accelerate's process-wide state is reset between cases.
"""

import contextlib
import importlib
import io
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "recipes"))
import datasets.config  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from huggingface_hub import constants as hub_constants  # noqa: E402

from toolkit.cli.recipe import cli  # noqa: E402

cases_path, out_path = sys.argv[1], sys.argv[2]  # sys.argv becomes each case's command line below
cases = json.load(open(cases_path))
results = {}
hub_offline = hub_constants.HF_HUB_OFFLINE
for case in cases:
    saved_env = dict(os.environ)
    os.environ.update(case.get("env", {}))
    recipe = case.get("recipe", "gpt2")
    main = importlib.import_module(recipe).main  # the recipe itself, unchanged
    sys.argv = [f"recipes/{recipe}.py", *case["argv"]]
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli(main)
        except SystemExit as e:
            code = e.code
        except Exception as e:  # a traceback is a failure of the case; record it
            import traceback

            code = f"exception {type(e).__name__}"
            err.write(traceback.format_exc())
    os.environ.clear()
    os.environ.update(saved_env)
    # a case's offline variables put this process's Hub libraries offline (toolkit.env.hub): not the next case's
    hub_constants.HF_HUB_OFFLINE = hub_offline
    datasets.config.HF_HUB_OFFLINE = hub_offline
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    results[case["name"]] = {"code": code, "stderr": err.getvalue(),
                             "weights_loaded": "weights train in" in out.getvalue() + err.getvalue()}
with open(out_path, "w") as f:
    json.dump(results, f, indent=1)
