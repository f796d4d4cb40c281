"""Tensor parallelism without a process: which checkpoint layouts a TP run may resume (``resume.load_plan``). The
real HSDP and TP runs are in tests/launch/test_parallel.py."""

import pytest

pytestmark = pytest.mark.slow  # as in tests/launch/test_parallel.py, where these tests were


@pytest.mark.parametrize("wrote, world, strategy, ranks, field", [
    ("tp", 2, "ddp", 2, "resume_from_checkpoint"),
    ("tp", 2, "tp", 4, "parallelism_config_tp_size"),
    ("ddp", 2, "tp", 2, "resume_from_checkpoint"),
])
def test_tensor_parallel_checkpoint_refused_on_another_layout(wrote, world, strategy, ranks, field):
    """A TP checkpoint loads only under TP with its tp_size (and no other strategy's under TP): refused before the
    weights load, naming the field and the launch that resumes it (the same check refused a real TP checkpoint under
    ddp.yaml before its weights loaded)."""
    from toolkit.checkpointing.resume import load_plan
    from toolkit.errors import ConfigError

    assert load_plan("ck", {"strategy": "tp", "loop": {"world_size": 2}}, "tp", 2) is None
    with pytest.raises(ConfigError) as e:
        load_plan("ck", {"strategy": wrote, "loop": {"world_size": world}}, strategy, ranks)
    config = "tp.yaml --num_processes 2 --parallelism_config_tp_size 2" if wrote == "tp" else "ddp.yaml"
    assert e.value.field_name == field and f"--config_file accelerate_configs/{config} <recipe>" in str(e.value)
