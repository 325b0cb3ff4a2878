"""kvpool.cache."""
