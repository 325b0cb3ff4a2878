"""kvpool.model."""
