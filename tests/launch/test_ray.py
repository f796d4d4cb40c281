"""Ray Train (issue 29, point 1): scripts/ray_train.py runs the recipe, unchanged, in Ray's TorchTrainer workers on a
local Ray cluster (2 CPU workers, loopback), and the job ends with the weights of ``accelerate launch
--num_processes 2``:

- under ZeRO-3 (the launch config's DeepSpeed settings applied as accelerate launch applies them): within 1e-6 of the
  DDP run, as the two-machine ZeRO-3 run is (tests/launch/test_multinode.py), each worker running stage 3, also with
  those settings already in the driver's environment (and not in the workers': the cluster was started before), as
  on a cluster of other machines;
- under DDP with rank 1 SIGKILLed after step 2 (tests/scripts/elastic_run.py): Ray restarts the worker group
  (FailureConfig), the restart resumes the step-1 checkpoint Ray was told of (``ray.train.get_checkpoint()``), and the
  run ends bit-identical to the uninterrupted one, Ray's ``Result.checkpoint`` naming its last checkpoint.

One Ray cluster for the module (ray.init 5 s); each fit costs about 25 s, so the two fits above are all there is.
The reference is conftest.py's ``one_machine_run`` (shared with test_multinode.py and test_strategies.py).
"""

import json
import os
import sys

import pytest
import yaml
from helpers import CONFIGS, ROOT, SCRIPTS, cluster_job_args, load_weights, max_abs_diff, subprocess_env

ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]' (.ci/install does)")

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import ray_train  # noqa: E402

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster of 2 CPUs for the module; its workers get the environment of every launched test."""
    saved = dict(os.environ)
    os.environ.update(subprocess_env())
    os.environ.update(RAY_AUTH_MODE="disabled", RAY_TRAIN_ENABLE_PRINT_PATCH="0")
    # Ray's controller looks at its workers every 0.5 s, not 2 s: a reported checkpoint is committed (each save
    # waits for it) and a dead worker seen sooner
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.5"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    yield
    ray.shutdown()
    os.environ.clear()
    os.environ.update(saved)


def _fit(runs, out: str, script: str, config: str, extra: dict | None = None, **env):
    argv = cluster_job_args(runs, out, **(extra or {}))
    saved = dict(os.environ)
    os.environ.update(env)  # the driver's only: Ray's workers have the environment the cluster started with
    try:
        result = ray_train.fit(ray_train.parse(["--num-workers", "2", "--max-failures", "1", "--config_file",
                                                os.path.join(CONFIGS, config), os.path.join(SCRIPTS, script), *argv]))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert result.error is None, result.error
    return result


def _reported(result) -> list[tuple]:
    """What the run told Ray, in order: (attempt, step, checkpoint folder) of every pointer."""
    records = [ray_train.reported_checkpoint(c) for c, _ in result.best_checkpoints]
    return [(r["attempt"], r["step"], r["checkpoint"]) for r in records]


def test_ray_train_under_zero3_equals_accelerate_launch(cluster, cluster_runs, one_machine_run, tmp_path):
    out = str(tmp_path / "ray-zero3")
    # exported in the driver, as a user may: the workers get them all the same (they were left out)
    result = _fit(cluster_runs, out, "probe_run.py", "zero3.yaml", ACCELERATE_USE_DEEPSPEED="true",
                  ACCELERATE_DEEPSPEED_ZERO_STAGE="3", ACCELERATE_MIXED_PRECISION="no")
    probes = [json.load(open(os.path.join(out, "probe", f"comm_rank{r}.json"))) for r in (0, 1)]
    assert [(p["num_processes"], p["process_index"], p["zero_stage"]) for p in probes] == [(2, 0, 3), (2, 1, 3)]
    assert probes[0]["weights_sha"] == probes[1]["weights_sha"]
    diff = max_abs_diff(load_weights(os.path.join(one_machine_run, "final")), load_weights(os.path.join(out, "final")))
    print(f"ray train (zero3.yaml): max |dw| vs accelerate launch DDP {diff:.1e}")
    assert diff <= 1e-6
    assert _reported(result) == [(0, None, None)]  # the attempt's start; no save_steps, no checkpoint


def test_ray_restarts_a_killed_worker_and_the_run_resumes_exactly(cluster, cluster_runs, one_machine_run, tmp_path):
    out = str(tmp_path / "ray-ddp-killed")
    # elastic_run.py: rank 1 SIGKILLs itself after step 2 of the first attempt, before that step's checkpoint
    result = _fit(cluster_runs, out, "elastic_run.py", "ddp.yaml", {"save_steps": 1})
    step = {n: os.path.join(out, "checkpoints", f"step-{n}") for n in (1, 2, 3)}
    # Ray's record: the first attempt's start and step-1; the restart (attempt 1, learnt from Ray on both ranks)
    # resumed step-1 and saved the rest; Ray's Result ends on the last one, where the toolkit wrote it (no copy)
    assert _reported(result) == [(0, None, None), (0, 1, step[1]), (1, 1, step[1]), (1, 2, step[2]), (1, 3, step[3])]
    assert ray_train.reported_checkpoint(result.checkpoint)["checkpoint"] == step[3]
    assert os.listdir(result.checkpoint.path) == [ray_train.POINTER]
    # the restart continued the run (toolkit.env.elastic) from the checkpoint Ray gave it
    assert yaml.safe_load(open(os.path.join(out, "config.yaml")))["resume_from_checkpoint"] == step[1]
    assert json.load(open(os.path.join(out, "summary.json")))["world_size"] == 2
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "step-3"
    diff = max_abs_diff(load_weights(os.path.join(one_machine_run, "final")), load_weights(os.path.join(out, "final")))
    print(f"ray train (ddp.yaml), rank 1 killed after step 2, restarted by Ray: max |dw| vs uninterrupted {diff:.1e}")
    assert diff == 0.0
