"""Beyond plain data parallel, through accelerate's ``ParallelismConfig``: HSDP (accelerate_configs/hsdp.yaml) on 4
real gloo ranks, 2 replicas x 2 shards, trains like one process on the same global batch, exports full weights that
``from_pretrained`` loads, and resumes from its checkpoint."""

from __future__ import annotations

import json
import os

import pytest
from helpers import Runs, copy_checkpoint, load_weights, max_abs_diff

pytestmark = pytest.mark.slow

COMMON = dict(packing=False, block_size=48, shuffle=True, max_steps=3, logging_steps=1, seed=7, report_to="none",
              per_device_eval_batch_size=3, optim="sgd", learning_rate=0.5, max_grad_norm=0,
              lr_scheduler_type="constant", weight_decay=0, save_steps=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, padded_data):
    return Runs(tmp_path_factory.mktemp("parallel"), tiny_model, padded_data, COMMON)


def _probe(out: str, rank: int) -> dict:
    with open(os.path.join(out, "probe", f"comm_rank{rank}.json")) as f:
        return json.load(f)


def test_hsdp_on_four_ranks_equals_one_process(runs):
    reference = runs.get("one", None, 1, 8, 1, {})
    hsdp = runs.get("hsdp", "hsdp.yaml", 4, 2, 1, {})
    assert max_abs_diff(load_weights(os.path.join(reference, "final")), load_weights(os.path.join(hsdp, "final"))) <= 1e-6
    for rank in range(4):
        probe = _probe(hsdp, rank)
        assert probe["num_processes"] == 4 and probe["is_fsdp2"]
        assert probe["placements"] == ["R", "S(0)"]  # Replicate() across the 2 groups, Shard(0) within each


def test_hsdp_exports_full_weights_and_resumes(runs):
    from transformers import AutoModelForCausalLM

    hsdp = runs.get("hsdp", "hsdp.yaml", 4, 2, 1, {})
    model = AutoModelForCausalLM.from_pretrained(os.path.join(hsdp, "final"))
    assert sum(p.numel() for p in model.parameters()) > 0
    resumed = runs.get("hsdp_resumed", "hsdp.yaml", 4, 2, 1, {"resume_from_checkpoint": "latest"},
                       prepare=copy_checkpoint(hsdp, 2))
    assert max_abs_diff(load_weights(os.path.join(hsdp, "final")), load_weights(os.path.join(resumed, "final"))) == 0.0
