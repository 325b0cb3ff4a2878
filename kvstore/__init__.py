"""kvpool.kvstore."""
