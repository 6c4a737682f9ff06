"""The kdpemb version (kept free of imports so that packaging can read it)."""

__version__ = "0.1.0"
