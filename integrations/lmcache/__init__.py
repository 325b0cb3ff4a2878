"""LMCache's L2 tier over kvpool's store (``l2_adapter.KvpoolL2Adapter``, loaded by ``lmcache server
--l2-adapter '{"type": "plugin", ...}'``); docs/design/lmcache.md."""
