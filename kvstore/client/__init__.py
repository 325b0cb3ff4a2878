"""kvpool.kvstore.client."""
