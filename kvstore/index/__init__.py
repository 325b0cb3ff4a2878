"""kvpool.kvstore.index."""
