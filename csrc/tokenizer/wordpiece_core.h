// The per-character and per-word steps of BERT WordPiece, shared by the CPU tokenizer and the CUDA
// kernels (csrc/cuda/): the normalization-table lookup, UTF-8 encoding, LinMaxMatch over a
// double-array trie, and the rare canonical-reordering path. Plain structs of pointers, no STL, so
// that nvcc can compile every function for the device as well.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FB_HD __host__ __device__ __forceinline__
#else
#define FB_HD inline
#endif

namespace fastbert {

// ---------------------------------------------------------------------------------------------
// Normalization table: code point -> the normalized characters HF's BertNormalizer makes of it,
// each with its pre-tokenizer class. Built per option set by normalizer.cpp.
// ---------------------------------------------------------------------------------------------

// Pre-tokenizer classes of normalized characters.
enum CharClass : uint32_t {
  kSep = 0,       // whitespace: ends a word, never a token
  kWord = 1,      // joins its neighbours into a word
  kIsolated = 2,  // punctuation or a CJK ideograph: a word of its own
};

// Table entry bits.
constexpr uint32_t kIdentity = 1u << 31;   // output is the input character, class in bits 29-30
constexpr uint32_t kClassShift = 29;
constexpr uint32_t kReorder = 1u << 28;    // keeps a non-starter (combining class > 0) after strip_accents
constexpr uint32_t kInvalid = 1u << 27;    // lone surrogate
constexpr uint32_t kControl = 1u << 26;    // dropped by clean_text (before NFD: no effect on ordering)
constexpr uint32_t kNonStarter = 1u << 25; // its NFD holds a non-starter, kept or stripped (strip_accents)
constexpr uint32_t kLenMask = 0xF;         // non-identity: bits 0-3 = number of output characters,
constexpr uint32_t kOffsetShift = 4;       //               bits 4-24 = offset into the pool
constexpr uint32_t kOffsetMask = (1u << 21) - 1;
// Pool items: code point in bits 0-20, class in bits 21-22.
constexpr uint32_t kPoolClassShift = 21;
constexpr uint32_t kCpMask = (1u << 21) - 1;
constexpr int kBlockShift = 7;  // two-stage table: stage1[cp >> 7] * 128 + (cp & 127)

struct NormView {
  const uint16_t* stage1;
  const uint32_t* stage2;
  const uint32_t* pool;
  FB_HD uint32_t lookup(uint32_t cp) const {
    return stage2[(static_cast<uint32_t>(stage1[cp >> kBlockShift]) << kBlockShift) |
                  (cp & ((1u << kBlockShift) - 1))];
  }
};

// Canonical decompositions and combining classes, for the canonical-reordering path only.
struct NfdView {
  const uint32_t* dec_cp;     // sorted code points that decompose (Hangul syllables excluded)
  const uint32_t* dec_start;  // their decomposition: pool[dec_start[i], dec_start[i] + dec_len[i])
  const uint32_t* dec_len;
  const uint32_t* pool;
  int32_t n_dec;
  const uint32_t* ccc_lo;  // sorted runs [lo, hi] of one nonzero combining class
  const uint32_t* ccc_hi;
  const uint32_t* ccc_val;
  int32_t n_ccc;

  FB_HD uint32_t combining_class(uint32_t cp) const {
    int lo = 0, hi = n_ccc - 1;
    while (lo <= hi) {
      int mid = (lo + hi) >> 1;
      if (cp < ccc_lo[mid]) hi = mid - 1;
      else if (cp > ccc_hi[mid]) lo = mid + 1;
      else return ccc_val[mid];
    }
    return 0;
  }
  // Writes the NFD of cp (at most 4 code points for non-Hangul; Hangul: 2-3) to out; returns count.
  FB_HD int decompose(uint32_t cp, uint32_t* out) const {
    if (cp >= 0xAC00 && cp <= 0xD7A3) {  // Hangul syllable: L V (T), all starters
      uint32_t s = cp - 0xAC00;
      out[0] = 0x1100 + s / 588;
      out[1] = 0x1161 + (s % 588) / 28;
      if (s % 28 == 0) return 2;
      out[2] = 0x11A7 + s % 28;
      return 3;
    }
    int lo = 0, hi = n_dec - 1;
    while (lo <= hi) {
      int mid = (lo + hi) >> 1;
      if (cp < dec_cp[mid]) hi = mid - 1;
      else if (cp > dec_cp[mid]) lo = mid + 1;
      else {
        uint32_t n = dec_len[mid];
        for (uint32_t k = 0; k < n; ++k) out[k] = pool[dec_start[mid] + k];
        return static_cast<int>(n);
      }
    }
    out[0] = cp;
    return 1;
  }
};

FB_HD int utf8_encode(uint32_t cp, uint8_t* out) {
  if (cp < 0x80) { out[0] = static_cast<uint8_t>(cp); return 1; }
  if (cp < 0x800) {
    out[0] = static_cast<uint8_t>(0xC0 | (cp >> 6));
    out[1] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    out[0] = static_cast<uint8_t>(0xE0 | (cp >> 12));
    out[1] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
    out[2] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
    return 3;
  }
  out[0] = static_cast<uint8_t>(0xF0 | (cp >> 18));
  out[1] = static_cast<uint8_t>(0x80 | ((cp >> 12) & 0x3F));
  out[2] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
  out[3] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
  return 4;
}

FB_HD int utf8_length(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

// ---------------------------------------------------------------------------------------------
// Canonical reordering (rare). With strip_accents, HF applies NFD to the whole text, which sorts
// each run of non-starters by combining class, across character boundaries. The per-character
// table cannot express that, so a word that keeps a non-starter next to other non-starters
// (kReorder, kNonStarter) is normalized again here from its original characters: same bytes,
// possibly permuted. Offsets follow HF's alignment rule: in output order, the first element of
// each character's decomposition takes the span of the next original character; the others take
// the span of the last one taken (so a moved mark may carry its neighbour's offsets).
// `char_at(i)` reads original character i of [begin, end); the word's normalized characters come
// from [first, last], widened here to whole runs. The run buffers hold `capacity` non-starters.
// Writes the word's bytes and each byte's original index; returns the byte count, or -1 if a run
// outgrows `capacity`.
// ---------------------------------------------------------------------------------------------
template <class CharAt, typename OrigT>
FB_HD int reorder_word(const NormView& norm, const NfdView& nfd, CharAt char_at, int64_t begin, int64_t end,
                       int64_t first, int64_t last, uint8_t* bytes, OrigT* orig, uint32_t* run_cp,
                       uint32_t* run_key, int capacity) {
  auto is_control = [&](uint32_t cp) { return (norm.lookup(cp) & kControl) != 0; };
  uint32_t dec[4];
  auto only_nonstarters = [&](uint32_t cp) {
    const int m = nfd.decompose(cp, dec);
    for (int k = 0; k < m; ++k)
      if (nfd.combining_class(dec[k]) == 0) return false;
    return true;
  };
  int64_t lo = first, hi = last;  // widen to the runs the word's ends belong to
  while (lo > begin && (is_control(char_at(lo - 1)) || only_nonstarters(char_at(lo - 1)))) --lo;
  while (hi + 1 < end && (is_control(char_at(hi + 1)) || only_nonstarters(char_at(hi + 1)))) ++hi;

  int n = 0, run = 0;
  int64_t cursor = lo - 1;  // the original character taken last
  auto put = [&](uint32_t cp, bool takes_next) {
    if (takes_next) {
      do ++cursor; while (is_control(char_at(cursor)));
    }
    const OrigT at = static_cast<OrigT>(cursor);
    const uint32_t e = norm.lookup(cp);  // cp is NFD-stable: entry = lowercase(cp), or nothing if it is Mn
    if (e & kIdentity) {
      const int k = utf8_encode(cp, bytes + n);
      for (int j = 0; j < k; ++j) orig[n + j] = at;
      n += k;
      return;
    }
    const uint32_t len = e & kLenMask, off = (e >> kOffsetShift) & kOffsetMask;
    for (uint32_t j = 0; j < len; ++j) {
      const int k = utf8_encode(norm.pool[off + j] & kCpMask, bytes + n);
      for (int q = 0; q < k; ++q) orig[n + q] = at;
      n += k;
    }
  };
  // run_key: combining class << 1 | (first element of its character's decomposition).
  auto flush = [&]() {
    for (int j = 0; j < run; ++j) put(run_cp[j], run_key[j] & 1);
    run = 0;
  };
  for (int64_t i = lo; i <= hi; ++i) {
    const uint32_t cp = char_at(i);
    if (is_control(cp)) continue;  // removed before NFD
    const int m = nfd.decompose(cp, dec);
    for (int k = 0; k < m; ++k) {
      const uint32_t d = dec[k], ccc = nfd.combining_class(d);
      if (ccc == 0) {
        flush();
        put(d, k == 0);
        continue;
      }
      if (run == capacity) return -1;
      int j = run++;  // stable insertion by combining class
      while (j > 0 && (run_key[j - 1] >> 1) > ccc) {
        run_cp[j] = run_cp[j - 1];
        run_key[j] = run_key[j - 1];
        --j;
      }
      run_cp[j] = d;
      run_key[j] = ccc << 1 | (k == 0 ? 1u : 0u);
    }
  }
  flush();
  return n;
}

// ---------------------------------------------------------------------------------------------
// WordPiece: LinMaxMatch (Song et al., "Fast WordPiece Tokenization", 2021) over a byte-level
// double-array trie. Word-initial tokens hang off the root; "##" tokens off the suffix root,
// which is the root's child on byte 0xFF (never in UTF-8, so no word reaches it by accident).
// Every node has a failure link and "failure pops": the tokens that greedy longest-match-first
// emits when the next byte has no edge. Each byte is consumed once, plus one pop per token.
// ---------------------------------------------------------------------------------------------
// One node (double-array slot), 16 bytes: the edge check, the next edges and the failure data
// share a cache line.
struct TrieNode {
  int32_t base;   // children of this node live at base + byte
  int32_t check;  // parent node of this slot, -1 if free
  int32_t fail;   // failure link, -1: no way on (the word is [UNK])
  uint32_t pops;  // failure pops: count in bits 0-7, offset into TrieView::pops in bits 8-31
};
// Pop entries: token id in bits 0-23, bytes it covers (without "##") in bits 24-31.
constexpr uint32_t kPopIdMask = (1u << 24) - 1;

struct TrieView {
  const TrieNode* nodes;
  const uint32_t* pops;
  int32_t root;
  int32_t suffix_root;
};

// Greedy longest-match-first pieces of one normalized word (UTF-8 bytes w[0, n)). Calls
// emit(k, id, byte_begin, byte_end) for the k-th piece; returns the piece count, or -1 when some
// piece cannot be matched (the caller then emits one [UNK] for the whole word and discards the
// pieces already emitted).
template <class Emit>
FB_HD int match_word(const TrieView& t, const uint8_t* w, int n, Emit&& emit) {
  int32_t u = t.root;
  int count = 0, pos = 0;
  auto pop = [&](const TrieNode& node) {
    const uint32_t* p = t.pops + (node.pops >> 8);
    for (uint32_t k = 0, m = node.pops & 0xFF; k < m; ++k) {
      const int len = static_cast<int>(p[k] >> 24);
      emit(count++, static_cast<int32_t>(p[k] & kPopIdMask), pos, pos + len);
      pos += len;
    }
    return node.fail;
  };
  for (int i = 0; i < n; ++i) {
    const int32_t c = w[i];
    for (;;) {
      const int32_t next = t.nodes[u].base + c;
      if (t.nodes[next].check == u) {
        u = next;
        break;
      }
      const TrieNode& node = t.nodes[u];
      if (node.fail < 0) return -1;
      u = pop(node);
    }
  }
  while (u != t.suffix_root) {
    const TrieNode& node = t.nodes[u];
    if (node.fail < 0) return -1;
    u = pop(node);
  }
  return count;
}

}  // namespace fastbert
