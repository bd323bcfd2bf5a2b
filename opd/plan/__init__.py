"""Planning before a run: the memory plan, the dry run at the real shapes (``opd plan``) and layer extrapolation."""
