"""The package as a user installs it: a wheel built from the checkout (no network, no build isolation), installed into a
fresh virtual environment, used from a folder with no checkout in sight. An editable install (what every other test
uses) hides a package missing from the wheel: issue 45 found ``toolkit.checkpointing`` left out of setup.cfg's list,
so ``import toolkit.training.loop`` failed in any wheel install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT, subprocess_env


def _checkout_copy(dest: Path) -> Path:
    """The files a clean checkout of this working tree has (tracked, and new files git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.splitlines()
    for name in listed:
        if os.path.isfile(os.path.join(ROOT, name)):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), dest / name)
    return dest


def _outside_env() -> dict:
    """No checkout on the path: the subprocess sees the venv's toolkit or none."""
    env = subprocess_env()
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.slow
def test_a_wheel_holds_every_module_and_runs_the_recipe_from_a_fresh_environment(tmp_path):
    source = _checkout_copy(tmp_path / "checkout")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True, env=_outside_env())
    (wheel,) = (tmp_path / "dist").glob("toolkit-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in Path(ROOT, "toolkit").rglob("*.py") if "__pycache__" not in p.parts}
    assert "toolkit/checkpointing/manager.py" in modules and "toolkit/tasks/grpo/task.py" in modules  # the walk walks
    assert not modules - inside, f"modules missing from the wheel: {sorted(modules - inside)}"
    shipped = {f"toolkit/recipes/{p.name}" for p in Path(ROOT, "recipes").glob("*.py")}
    shipped |= {f"toolkit/recipes/configs/{p.name}" for p in Path(ROOT, "recipes", "configs").glob("*.yaml")}
    shipped |= {f"toolkit/accelerate_configs/{p.name}" for p in Path(ROOT, "accelerate_configs").glob("*.yaml")}
    assert not shipped - inside, f"recipes or launch configs missing from the wheel: {sorted(shipped - inside)}"

    # A fresh environment: this interpreter's dependencies (system site packages), the wheel's toolkit, no checkout.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python, toolkit = str(venv / "bin" / "python"), str(venv / "bin" / "toolkit")
    env, elsewhere = _outside_env(), tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], check=True,
                   capture_output=True, env=env, cwd=elsewhere)
    where = subprocess.run([python, "-c", "import toolkit.training.loop, toolkit.recipes, os; "
                            "print(os.path.dirname(toolkit.__file__))"], capture_output=True, text=True, env=env,
                           cwd=elsewhere, check=True).stdout.strip()
    assert where.startswith(str(venv)), f"toolkit imported from {where}, not from the installed wheel"

    shown = subprocess.run([toolkit, "train", "lm", "--help"], capture_output=True, text=True, env=env, cwd=elsewhere)
    assert shown.returncode == 0 and "learning_rate" in shown.stdout, shown.stderr[-2000:]

    # README command 1's recipe (recipes/gpt2.py, as shipped in the wheel) trains through `toolkit train`, 2 steps of
    # a tiny GPT-2 written by `toolkit offline` on the built-in pydoc text.
    model = elsewhere / "tiny-gpt2"
    subprocess.run([toolkit, "offline", "tiny-gpt2", str(model), "--n-layer", "1", "--n-embd", "32"], check=True,
                   capture_output=True, env=env, cwd=elsewhere)
    run = subprocess.run([toolkit, "train", "lm", "--config", os.path.join(where, "recipes/configs/tiny_gpt2_pydoc.yaml"),
                          "--model", str(model), "--num_processes", "1", "--output_dir", str(elsewhere / "run"),
                          "--max_steps", "2", "--eval_steps", "2", "--max_eval_samples", "8", "--report_to", "none"],
                         capture_output=True, text=True, env=env, cwd=elsewhere, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert os.path.join(where, "recipes", "gpt2.py") in run.stdout  # the wheel's recipe ran, not a checkout's
    assert (elsewhere / "run" / "final" / "model.safetensors").is_file()
