"""kvpool.kvstore.protocol."""
