"""kvpool.worker."""
