"""Integrations of flash3 with other libraries; each submodule imports its library only
when used, so that flash3 does not depend on it.

* :mod:`flash3.integrations.transformers`: flash3 as an attention backend of Hugging Face
  transformers (``register()``, then ``attn_implementation="hopper_attention"``).
"""
import importlib

__all__ = ["transformers"]


def __getattr__(name):
    if name in __all__:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
