"""Integrations of adalncache with model libraries (each imports its library lazily)."""
