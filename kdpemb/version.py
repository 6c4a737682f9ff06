"""The kdpemb version (kept free of imports so that packaging can read it)."""

__version__ = "0.2.0"
"""The version of kdpemb, "MAJOR.MINOR.PATCH".

Example:

>>> import kdpemb
>>> major, minor, patch = map(int, kdpemb.__version__.split("."))
"""
