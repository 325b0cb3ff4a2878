"""kvpool.decode."""
