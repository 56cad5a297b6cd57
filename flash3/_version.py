"""flash3's version, in one place: setup.py (through pyproject.toml) and flash3.__version__ read it."""
__version__ = "0.2.0"
