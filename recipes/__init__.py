"""Recipes: thin scripts over toolkit (run them as files: ``python recipes/gpt2.py``). Installed as toolkit.recipes."""
