"""Metadata, dependencies and tool settings live in setup.cfg; this file only finds the packages, which setup.cfg
cannot do together with the two folders it maps into the package (recipes/ and accelerate_configs/)."""

from setuptools import find_packages, setup

# Every package under toolkit/ (found, so that a new subpackage cannot be left out of a wheel: issue 45's bug was a
# hand-written list without toolkit.checkpointing), and the recipes and launch configs shipped inside it.
setup(packages=find_packages(include=["toolkit", "toolkit.*"]) + ["toolkit.recipes", "toolkit.accelerate_configs"])
