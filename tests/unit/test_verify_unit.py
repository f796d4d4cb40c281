"""``toolkit verify``'s own options cannot be mistaken for recipe fields (its parser, in process). verify run for real
is in tests/launch/test_verify.py."""

import pytest

from toolkit.config import field_names
from toolkit.verify import _parser, own_options


def test_verify_options_never_swallow_a_recipe_field():
    """`--optim` used to be verify's own option, so a recipe's `--optim adamw_torch` ran the SGD check alone and
    still said PASS. No verify option may share a name with a recipe field; recipe fields pass through."""
    assert not own_options() & set(field_names())
    args, recipe_args = _parser().parse_known_args(["--config_file", "x.yaml", "--optim", "sgd", "--checks", "adamw",
                                                    "--learning_rate", "0.1"])
    assert args.checks == ["adamw"]
    assert recipe_args == ["--optim", "sgd", "--learning_rate", "0.1"]
    with pytest.raises(SystemExit):
        _parser().parse_args(["--config_file", "x.yaml", "--checks", "sgd,adam"])
