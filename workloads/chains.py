"""Block hash chains of requests, as the simulator feeds them to the master's index.

Two sources, one shape (a list of 32-byte hashes h_0..h_{n-1} plus tokens per block):

- **Token records** (generators, converted traces): the production chain of ``kvpool.cache.hashing``
  (``hash_blocks`` over full blocks from ``root_hash(fingerprint, tenant)``), so a simulated key is the
  key the gateway would compute. Only full blocks are hashed; the partial tail is request-scoped.
- **Hash-id records** (Mooncake traces, no tokens): block i of a request is the trace's ``hash_ids[i]``
  (512 tokens, the last one possibly partial, exactly as the published hit-rate numbers count it), and
  ``h_i = SHA-256(h_{i-1} || TRACE_ROOT || le64(hash_ids[i]))`` from the tenant's root (h_{-1}). Trace ids are
  already chained (equal id => equal prefix), so h_i depends only on (tenant, id) and is memoised per id
  (compiled: ``workloads/id_chains.pyx``).
"""

from __future__ import annotations

import contextlib
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.cache.hashing import canonical_tokens, check_block_size, hash_block, root_hash
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.id_chains import TenantIds
from kvpool.workloads.trace import Request


@dataclass(frozen=True, slots=True)
class Chain:
    """The cacheable blocks of one request: prompt blocks, then (optionally) blocks closed by the output."""

    hashes: list[bytes]  # prompt blocks first, then output blocks
    block_tokens: list[int]  # tokens in each block (all == block size except a trace's partial last)
    prompt_blocks: int  # how many of ``hashes`` belong to the prompt
    full_prompt_blocks: int  # prompt blocks that are full (where an end-of-prompt checkpoint may sit)


def model_fingerprint(spec_name: str) -> bytes:
    """A stand-in 32-byte fingerprint per spec so chains of different simulated models never meet."""
    return hashlib.sha256(b"kvpool-sim-model|" + spec_name.encode()).digest()


class ChainBuilder:
    """Computes chains for requests of one simulated model; memoises what repeats across requests."""

    def __init__(self, spec_name: str, block_size: int) -> None:
        self.fingerprint = model_fingerprint(spec_name)
        self.block_size = block_size
        self._roots: dict[str, bytes] = {}
        self._id_hashes: dict[str, TenantIds] = {}  # tenant -> its trace id -> h memo (compiled)
        # (parent h, SHA-256 of the block's tokens as 64-bit words) -> h: turns re-send their history
        self._block_hash: dict[tuple[bytes, bytes], bytes] = {}

    def _root(self, tenant: str) -> bytes:
        root = self._roots.get(tenant)
        if root is None:
            root = self._roots[tenant] = root_hash(self.fingerprint, tenant)
        return root

    def chain(self, req: Request, with_output: bool = False) -> Chain:
        """The chain of ``req``; ``with_output`` appends the blocks its reply closes, as decode pushes them
        (full blocks of prompt + reply without its last token, which is sampled but never fed; token records
        with ``output_tokens`` only: a trace does not know its reply's ids)."""
        if req.tokens is not None:
            return self._token_chain(req, with_output)
        if req.hash_ids is not None:
            return self._id_chain(req)
        raise ReplayError(f"request {req.request_id} has neither tokens nor hash_ids")

    def _token_chain(self, req: Request, with_output: bool) -> Chain:
        b = self.block_size
        assert req.tokens is not None
        toks = req.tokens
        full = len(toks) // b
        if with_output and req.output_tokens:
            toks = toks + req.output_tokens[:-1]  # decode never feeds its last sampled token
        hashes = self._token_hashes(toks, self._root(req.tenant))
        return Chain(hashes, [b] * len(hashes), full, full)

    def _token_hashes(self, toks: list[int], root: bytes) -> list[bytes]:
        """``hash_blocks(toks, block_size, root)``, memoised per block: a conversation's turns re-send its
        whole history, and hashing a block (canonical tokens, CBOR, SHA-256) costs ~50x looking it up.

        The same hashes and the same errors: each block is hashed by ``hash_block`` (what ``hash_blocks``
        chains) the first time its parent and tokens are seen, and looked up after; a block whose tokens
        are not all plain ints in [0, 2^64) is never looked up (``hash_block`` checks it and raises as
        ``hash_blocks`` would), and the partial tail, never hashed, is checked last, as in order."""
        b = check_block_size(self.block_size)
        end = len(toks) // b * b
        memo = self._block_hash
        out: list[bytes] = []
        parent = root
        for i in range(0, end, b):
            block = toks[i : i + b]
            words = None
            if set(map(type, block)) == {int}:  # no bool, no numpy int: those take hash_block's checks
                with contextlib.suppress(OverflowError):  # a negative or too large id: hash_block raises
                    words = array("Q", block).tobytes()
            if words is None:
                h = bytes(hash_block(parent, block))
            else:
                key = (parent, hashlib.sha256(words).digest())
                h = memo.get(key)
                if h is None:
                    h = memo[key] = bytes(hash_block(parent, block))
            out.append(h)
            parent = h
        canonical_tokens(toks[end:])
        return out

    def _id_chain(self, req: Request) -> Chain:
        assert req.hash_ids is not None
        ids = self._id_hashes.get(req.tenant)
        if ids is None:
            ids = self._id_hashes[req.tenant] = TenantIds(self._root(req.tenant))
        hashes = ids.chain(req.hash_ids)
        n = len(hashes)
        bs = req.block_size
        sizes = [bs] * n
        if n and req.input_length % bs:
            sizes[-1] = req.input_length % bs
        full = req.input_length // bs
        return Chain(hashes, sizes, n, full)


def warmed_builder(requests: Sequence[Request], spec_name: str, block_size: int) -> ChainBuilder:
    """A builder that has already seen ``requests``, in the simulator's order (arrival, stable), so it
    holds every hash a simulation of them computes. Why: a sweep simulates one trace at many capacities,
    and hashing its blocks is about a quarter of an LRU point; built once before the points (a pool's
    forked workers inherit it), each point only looks its chains up. The hashes are the ones a fresh
    builder computes, since it meets the requests in the same order."""
    builder = ChainBuilder(spec_name, block_size)
    for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms):
        builder.chain(requests[i], with_output=True)
    return builder
