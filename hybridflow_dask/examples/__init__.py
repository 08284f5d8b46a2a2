"""Runnable examples of the single-controller model (``hybridflow-dask demo`` runs GRPO)."""
