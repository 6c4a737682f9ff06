"""Moved to `kdpemb._validation`; kept while imports move over."""

from kdpemb._validation import *  # noqa: F403
from kdpemb._validation import _suggest_delta  # noqa: F401
