"""Where the expert cache's slots live: one module per tier, named in registry.py (what `--tier` accepts)."""
