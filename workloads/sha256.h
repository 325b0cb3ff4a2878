// SHA-256 (FIPS 180-4) of short messages, for the simulator's hash-id chains (`id_chains.pyx`).
//
// Why not hashlib: a chain block is one SHA-256 of 63 bytes, and hashlib's per-call setup (an OpenSSL
// digest context made, initialised and freed, two Python objects) costs several times the compression
// itself; a production trace hashes tens of millions of blocks. Here a digest is a function call on the
// stack.
//
// Two ways to compress a 64-byte block, chosen once per process: the x86 SHA extensions where the CPU has
// them (every AMD Zen, Intel since Ice Lake), else the portable rounds. Both are checked against hashlib
// (tests/test_workloads_id_chains.py), the portable one on every machine (`sha256_portable`).
//
// Errors: none; the caller passes a buffer of `len` bytes and 32 bytes for the digest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define KVPOOL_SHA_X86 1
#endif

namespace kvpool {
namespace sha256_detail {

// the first 32 bits of the fractional parts of the cube roots of the first 64 primes
alignas(16) static const std::uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

// the first 32 bits of the fractional parts of the square roots of the first 8 primes
static const std::uint32_t H0[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

inline std::uint32_t rotr(std::uint32_t x, unsigned n) { return (x >> n) | (x << (32 - n)); }

inline std::uint32_t load_be32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | p[3];
}

// One 64-byte block into `state`, the rounds as the standard writes them.
inline void compress_portable(std::uint32_t state[8], const std::uint8_t* block) {
  std::uint32_t w[64];
  for (int t = 0; t < 16; ++t) w[t] = load_be32(block + 4 * t);
  for (int t = 16; t < 64; ++t) {
    const std::uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    const std::uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  std::uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
  std::uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
  for (int t = 0; t < 64; ++t) {
    const std::uint32_t s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
    const std::uint32_t t1 = h + s1 + ((e & f) ^ (~e & g)) + K[t] + w[t];
    const std::uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state[0] += a;
  state[1] += b;
  state[2] += c;
  state[3] += d;
  state[4] += e;
  state[5] += f;
  state[6] += g;
  state[7] += h;
}

#ifdef KVPOOL_SHA_X86
// The same block with the SHA extensions: the state held as the instructions take it (ABEF and CDGH), four
// rounds per pair of `sha256rnds2`, the message schedule by `sha256msg1` / `sha256msg2` four words at a time.
__attribute__((target("sha,sse4.1"))) inline void compress_x86(std::uint32_t state[8],
                                                               const std::uint8_t* block) {
  const __m128i big_endian = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  __m128i dcba = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&state[0]));
  __m128i hgfe = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&state[4]));
  const __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
  const __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
  __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
  __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
  const __m128i abef_in = abef, cdgh_in = cdgh;
  __m128i w[16];
  for (int i = 0; i < 4; ++i) {
    w[i] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * i)), big_endian);
  }
  for (int i = 4; i < 16; ++i) {
    // w[t-16] + s0(w[t-15]), then + w[t-7], then + s1(w[t-2])
    __m128i m = _mm_sha256msg1_epu32(w[i - 4], w[i - 3]);
    m = _mm_add_epi32(m, _mm_alignr_epi8(w[i - 1], w[i - 2], 4));
    w[i] = _mm_sha256msg2_epu32(m, w[i - 1]);
  }
  for (int i = 0; i < 16; ++i) {
    __m128i m = _mm_add_epi32(w[i], _mm_load_si128(reinterpret_cast<const __m128i*>(&K[4 * i])));
    cdgh = _mm_sha256rnds2_epu32(cdgh, abef, m);
    m = _mm_shuffle_epi32(m, 0x0E);
    abef = _mm_sha256rnds2_epu32(abef, cdgh, m);
  }
  abef = _mm_add_epi32(abef, abef_in);
  cdgh = _mm_add_epi32(cdgh, cdgh_in);
  const __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
  const __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
  dcba = _mm_blend_epi16(feba, dchg, 0xF0);
  hgfe = _mm_alignr_epi8(dchg, feba, 8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(&state[0]), dcba);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(&state[4]), hgfe);
}

// CPUID, not `__builtin_cpu_supports("sha")`: GCC before 11 and clang before 18 refuse that name at compile
// time. SSE4.1 is leaf 1's ECX bit 19 (the blend and 8-byte align), SHA leaf 7's EBX bit 29.
inline bool cpu_has_sha() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 19))) return false;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (b & (1u << 29)) != 0;
}
#endif

using Compress = void (*)(std::uint32_t*, const std::uint8_t*);

inline Compress pick_compress() {
#ifdef KVPOOL_SHA_X86
  if (cpu_has_sha()) return compress_x86;
#endif
  return compress_portable;
}

// Padding and length, then every block through `compress`.
inline void digest(Compress compress, const std::uint8_t* msg, std::size_t len, std::uint8_t out[32]) {
  std::uint32_t state[8];
  std::memcpy(state, H0, sizeof state);
  std::size_t whole = len / 64 * 64;
  for (std::size_t i = 0; i < whole; i += 64) compress(state, msg + i);
  std::uint8_t tail[128] = {0};
  const std::size_t rest = len - whole;
  std::memcpy(tail, msg + whole, rest);
  tail[rest] = 0x80;
  const std::size_t tail_len = rest + 9 <= 64 ? 64 : 128;
  const std::uint64_t bits = static_cast<std::uint64_t>(len) * 8;
  for (int i = 0; i < 8; ++i) tail[tail_len - 1 - i] = static_cast<std::uint8_t>(bits >> (8 * i));
  for (std::size_t i = 0; i < tail_len; i += 64) compress(state, tail + i);
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = static_cast<std::uint8_t>(state[i] >> 24);
    out[4 * i + 1] = static_cast<std::uint8_t>(state[i] >> 16);
    out[4 * i + 2] = static_cast<std::uint8_t>(state[i] >> 8);
    out[4 * i + 3] = static_cast<std::uint8_t>(state[i]);
  }
}

}  // namespace sha256_detail

// SHA-256 of `len` bytes at `msg` into `out` (32 bytes), with the fastest compression this CPU has.
inline void sha256(const std::uint8_t* msg, std::size_t len, std::uint8_t out[32]) {
  static const sha256_detail::Compress compress = sha256_detail::pick_compress();
  sha256_detail::digest(compress, msg, len, out);
}

// The same digest by the portable rounds only (what a CPU without the SHA extensions runs; tested
// everywhere).
inline void sha256_portable(const std::uint8_t* msg, std::size_t len, std::uint8_t out[32]) {
  sha256_detail::digest(sha256_detail::compress_portable, msg, len, out);
}

}  // namespace kvpool
