"""Model families, one file each, found by `registry.py`."""
