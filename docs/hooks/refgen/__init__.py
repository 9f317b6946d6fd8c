"""Reference-page generators for docs/hooks/reference.py, one module per page."""
