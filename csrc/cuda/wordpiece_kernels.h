// The batched GPU tokenizer's kernels, one functor per data-parallel step, each called as k(i) for
// i in [0, k.n). csrc/cuda/wordpiece_cuda.cu launches them on the GPU; csrc/tokenizer/
// gpu_emulation.cpp runs the very same code in loops on the CPU, so CI tests the pipeline's logic
// without a GPU. fastbert/tokenization/_cuda.py chains them with torch scans:
//
//   count_chars  (per original character) normalized UTF-8 bytes it becomes (special tokens: 1)
//   write_chars  (per original character) the normalized bytes, each byte's original character and flags
//   word_starts  (per normalized byte)    does a word start here
//   word_tokens  (per word, twice)        WordPiece: count the pieces, then write ids and offsets
//   assemble     (per output position)    [CLS] a [SEP] b [SEP], truncation, padding
//
// Semantics are those of the CPU tokenizer (tokenizer.cpp); the shared steps are in
// csrc/tokenizer/wordpiece_core.h. Every functor is built by make(get) from named arrays and
// scalars: get.template ptr<T>(name) and get.scalar(name) check and fetch them.
#pragma once

#include <cstdint>

#include "../tokenizer/wordpiece_core.h"

namespace fastbert {
namespace gpu {

// Flags of a normalized byte.
constexpr uint8_t kClassMask = 3;    // kSep, kWord, kIsolated (wordpiece_core.h) or kSpecial
constexpr uint8_t kSpecial = 3;      // the byte holds a special token's index
constexpr uint8_t kCharStart = 4;    // first byte of a normalized character
constexpr uint8_t kKeeps = 8;        // its character keeps a non-starter: canonical-reordering check
constexpr int kRunCapacity = 64;     // non-starters in one run of the reordering path
constexpr int64_t kNoError = INT64_MAX;

FB_HD void record_error(unsigned long long* slot, int64_t position) {
#if defined(__CUDA_ARCH__)
  atomicMin(slot, static_cast<unsigned long long>(position));
#else
  if (static_cast<unsigned long long>(position) < *slot) *slot = static_cast<unsigned long long>(position);
#endif
}

// The batch's texts ("segments": texts, then pairs) as Python stores them, back to back.
struct Text {
  const uint8_t* data;      // raw code units; segment s starts at byte seg_byte[s]
  const int64_t* seg_byte;
  const int32_t* seg_kind;  // bytes per code point: 1, 2 or 4
  const int64_t* seg_char;  // global index of segment s's first character (n_segs + 1 entries)
  const int32_t* char_seg;  // segment of each global character
  int64_t n_chars;

  FB_HD uint32_t at(int64_t g) const {
    const int32_t s = char_seg[g];
    const int64_t i = g - seg_char[s];
    const uint8_t* p = data + seg_byte[s];
    switch (seg_kind[s]) {
      case 1: return p[i];
      case 2: return reinterpret_cast<const uint16_t*>(p)[i];
      default: return reinterpret_cast<const uint32_t*>(p)[i];
    }
  }
};

// Special tokens matched in the raw text, longest first; they never overlap (checked by the caller).
struct Specials {
  const uint32_t* chars;    // code points of every special token, back to back
  const int32_t* offsets;   // token k is chars[offsets[k], offsets[k + 1])
  const int32_t* ids;
  int32_t n;
  int32_t max_len;

  // Length of the special token starting at global character g (0: none); its index in *which.
  FB_HD int32_t match(const Text& t, int64_t g, int64_t seg_end, int32_t* which) const {
    for (int32_t k = 0; k < n; ++k) {
      const int32_t len = offsets[k + 1] - offsets[k];
      if (g + len > seg_end) continue;
      int32_t j = 0;
      while (j < len && t.at(g + j) == chars[offsets[k] + j]) ++j;
      if (j == len) {
        *which = k;
        return len;
      }
    }
    return 0;
  }
  // Is g inside (not at the start of) a special token?
  FB_HD bool covers(const Text& t, int64_t g, int64_t seg_begin, int64_t seg_end) const {
    int32_t which;
    for (int32_t k = 1; k < max_len && g - k >= seg_begin; ++k)
      if (match(t, g - k, seg_end, &which) > k) return true;
    return false;
  }
};

template <class Get>
Text text_from(Get& get) {
  return {get.template ptr<uint8_t>("text"), get.template ptr<int64_t>("seg_byte"),
          get.template ptr<int32_t>("seg_kind"), get.template ptr<int64_t>("seg_char"),
          get.template ptr<int32_t>("char_seg"), get.scalar("n_chars")};
}

template <class Get>
NormView norm_from(Get& get) {
  return {get.template ptr<uint16_t>("norm_stage1"), get.template ptr<uint32_t>("norm_stage2"),
          get.template ptr<uint32_t>("norm_pool")};
}

template <class Get>
Specials specials_from(Get& get) {
  return {get.template ptr<uint32_t>("special_chars"), get.template ptr<int32_t>("special_offsets"),
          get.template ptr<int32_t>("special_ids"), static_cast<int32_t>(get.scalar("n_specials")),
          static_cast<int32_t>(get.scalar("special_max_len"))};
}

// ------------------------------------------------------------------------------------------------
// 1. Normalized bytes per original character.
// ------------------------------------------------------------------------------------------------
struct CountChars {
  Text text;
  NormView norm;
  Specials specials;
  int32_t* out_bytes;
  unsigned long long* error;  // first lone surrogate (global character index)
  int64_t n;

  template <class Get>
  static CountChars make(Get& get) {
    return {text_from(get), norm_from(get), specials_from(get), get.template ptr<int32_t>("out_bytes"),
            get.template ptr<unsigned long long>("error"), get.scalar("n_chars")};
  }

  FB_HD void operator()(int64_t g) const {
    const int32_t s = text.char_seg[g];
    const int64_t begin = text.seg_char[s], end = text.seg_char[s + 1];
    if (specials.n > 0) {
      int32_t which;
      if (specials.covers(text, g, begin, end)) {
        out_bytes[g] = 0;
        return;
      }
      if (specials.match(text, g, end, &which) > 0) {
        out_bytes[g] = 1;
        return;
      }
    }
    const uint32_t cp = text.at(g);
    const uint32_t e = norm.lookup(cp);
    if (e & kIdentity) {
      out_bytes[g] = utf8_length(cp);
      return;
    }
    if (e & kInvalid) {
      record_error(error, g);
      out_bytes[g] = 0;
      return;
    }
    int32_t bytes = 0;
    const uint32_t len = e & kLenMask, off = (e >> kOffsetShift) & kOffsetMask;
    for (uint32_t k = 0; k < len; ++k) bytes += utf8_length(norm.pool[off + k] & kCpMask);
    out_bytes[g] = bytes;
  }
};

// ------------------------------------------------------------------------------------------------
// 2. Write the normalized bytes (at the exclusive prefix sum of count_chars).
// ------------------------------------------------------------------------------------------------
struct WriteChars {
  Text text;
  NormView norm;
  Specials specials;
  const int32_t* out_bytes;
  const int64_t* byte_pos;
  uint8_t* bytes;
  int32_t* orig;
  uint8_t* flags;
  int64_t n;

  template <class Get>
  static WriteChars make(Get& get) {
    return {text_from(get), norm_from(get), specials_from(get), get.template ptr<int32_t>("out_bytes"),
            get.template ptr<int64_t>("byte_pos"), get.template ptr<uint8_t>("bytes"),
            get.template ptr<int32_t>("orig"), get.template ptr<uint8_t>("flags"), get.scalar("n_chars")};
  }

  FB_HD void put(int64_t& at, uint32_t cp, uint32_t klass, uint8_t extra, int64_t g) const {
    const int k = utf8_encode(cp, bytes + at);
    for (int j = 0; j < k; ++j) {
      orig[at + j] = static_cast<int32_t>(g);
      flags[at + j] = static_cast<uint8_t>(klass | extra | (j == 0 ? kCharStart : 0));
    }
    at += k;
  }

  FB_HD void operator()(int64_t g) const {
    if (out_bytes[g] == 0) return;
    int64_t at = byte_pos[g];
    const int32_t s = text.char_seg[g];
    if (specials.n > 0) {
      int32_t which;
      if (specials.match(text, g, text.seg_char[s + 1], &which) > 0) {
        bytes[at] = static_cast<uint8_t>(which);
        orig[at] = static_cast<int32_t>(g);
        flags[at] = kSpecial | kCharStart;
        return;
      }
    }
    const uint32_t cp = text.at(g);
    const uint32_t e = norm.lookup(cp);
    const uint8_t keeps = (e & kReorder) ? kKeeps : 0;
    if (e & kIdentity) {
      put(at, cp, (e >> kClassShift) & 3, keeps, g);
      return;
    }
    const uint32_t len = e & kLenMask, off = (e >> kOffsetShift) & kOffsetMask;
    for (uint32_t k = 0; k < len; ++k) {
      const uint32_t item = norm.pool[off + k];
      put(at, item & kCpMask, item >> kPoolClassShift, keeps, g);
    }
  }
};

// ------------------------------------------------------------------------------------------------
// 3. Word starts: a non-separator character that follows a separator, punctuation, a special
//    token or another text, or is itself punctuation / an ideograph / a special token.
// ------------------------------------------------------------------------------------------------
struct WordStarts {
  const uint8_t* flags;
  const int32_t* orig;
  const int32_t* char_seg;
  uint8_t* is_start;
  int64_t n;

  template <class Get>
  static WordStarts make(Get& get) {
    return {get.template ptr<uint8_t>("flags"), get.template ptr<int32_t>("orig"),
            get.template ptr<int32_t>("char_seg"), get.template ptr<uint8_t>("is_start"), get.scalar("n_bytes")};
  }

  FB_HD void operator()(int64_t j) const {
    const uint8_t f = flags[j];
    const uint32_t klass = f & kClassMask;
    uint8_t start = 0;
    if ((f & kCharStart) && klass != kSep) {
      start = klass != kWord || j == 0 || (flags[j - 1] & kClassMask) != kWord ||
              char_seg[orig[j]] != char_seg[orig[j - 1]];
    }
    is_start[j] = start;
  }
};

// ------------------------------------------------------------------------------------------------
// 4. WordPiece per word. mode 0: canonical reordering in place where needed, count the tokens
//    (tok_count) and note the word's text (word_seg). mode 1: write ids and offsets (relative to
//    the word's text) at tok_pos.
// ------------------------------------------------------------------------------------------------
struct WordTokens {
  Text text;
  NormView norm;
  NfdView nfd;
  TrieView trie;
  Specials specials;
  uint8_t* bytes;
  int32_t* orig;
  const uint8_t* flags;
  const uint8_t* is_start;
  const int64_t* word_start;
  int32_t* tok_count;
  int32_t* word_seg;
  const int64_t* tok_pos;
  int32_t* tok_id;
  int32_t* tok_begin;
  int32_t* tok_end;
  unsigned long long* overflow;  // a word whose run of marks outgrew kRunCapacity
  int64_t n_bytes;
  int32_t max_chars;
  int32_t unk_id;
  int32_t mode;
  int64_t n;

  template <class Get>
  static WordTokens make(Get& get) {
    const int32_t mode = static_cast<int32_t>(get.scalar("mode"));
    NfdView nfd{get.template ptr<uint32_t>("dec_cp"), get.template ptr<uint32_t>("dec_start"),
                get.template ptr<uint32_t>("dec_len"), get.template ptr<uint32_t>("dec_pool"),
                static_cast<int32_t>(get.scalar("n_dec")), get.template ptr<uint32_t>("ccc_lo"),
                get.template ptr<uint32_t>("ccc_hi"), get.template ptr<uint32_t>("ccc_val"),
                static_cast<int32_t>(get.scalar("n_ccc"))};
    TrieView trie{reinterpret_cast<const TrieNode*>(get.template ptr<int32_t>("trie_nodes")),
                  get.template ptr<uint32_t>("trie_pops"), static_cast<int32_t>(get.scalar("root")),
                  static_cast<int32_t>(get.scalar("suffix_root"))};
    return {text_from(get), norm_from(get), nfd, trie, specials_from(get),
            get.template ptr<uint8_t>("bytes"), get.template ptr<int32_t>("orig"), get.template ptr<uint8_t>("flags"),
            get.template ptr<uint8_t>("is_start"), get.template ptr<int64_t>("word_start"),
            get.template ptr<int32_t>("tok_count"), get.template ptr<int32_t>("word_seg"),
            mode ? get.template ptr<int64_t>("tok_pos") : nullptr,
            mode ? get.template ptr<int32_t>("tok_id") : nullptr,
            mode ? get.template ptr<int32_t>("tok_begin") : nullptr,
            mode ? get.template ptr<int32_t>("tok_end") : nullptr,
            get.template ptr<unsigned long long>("overflow"), get.scalar("n_bytes"),
            static_cast<int32_t>(get.scalar("max_chars")), static_cast<int32_t>(get.scalar("unk_id")), mode,
            get.scalar("n_words")};
  }

  FB_HD void operator()(int64_t w) const {
    const int64_t start = word_start[w];
    const uint32_t klass = flags[start] & kClassMask;
    int64_t end = start + 1;
    while (end < n_bytes && !(flags[end] & kCharStart)) ++end;  // rest of the first character
    bool keeps = (flags[start] & kKeeps) != 0;
    int64_t nchars = 1;
    if (klass == kWord) {
      while (end < n_bytes) {
        const uint8_t f = flags[end];
        if (f & kCharStart) {
          if ((f & kClassMask) != kWord || is_start[end]) break;
          ++nchars;
          keeps |= (f & kKeeps) != 0;
        }
        ++end;
      }
    }
    const int32_t s = text.char_seg[orig[start]];
    const int64_t base = text.seg_char[s];
    if (mode == 0) word_seg[w] = s;
    if (klass == kSpecial) {
      const int32_t k = bytes[start];
      if (mode == 0) {
        tok_count[w] = 1;
      } else {
        const int64_t at = tok_pos[w];
        tok_id[at] = specials.ids[k];
        tok_begin[at] = static_cast<int32_t>(orig[start] - base);
        tok_end[at] = static_cast<int32_t>(orig[start] - base + specials.offsets[k + 1] - specials.offsets[k]);
      }
      return;
    }
    int32_t count = -1;
    if (nchars <= max_chars) {
      if (keeps && mode == 0) {
        uint32_t run_cp[kRunCapacity], run_key[kRunCapacity];
        const Text t = text;
        const int r = reorder_word(norm, nfd, [&t](int64_t g) { return t.at(g); }, base, text.seg_char[s + 1],
                                   orig[start], orig[end - 1], bytes + start, orig + start, run_cp, run_key,
                                   kRunCapacity);
        if (r < 0) record_error(overflow, w);
      }
      const int64_t at = mode ? tok_pos[w] : 0;
      // A word that turns out [UNK] has emitted some pieces first: only its one slot is ours.
      const int32_t slots = mode ? tok_count[w] : 0;
      const int32_t* o = orig + start;
      count = match_word(trie, bytes + start, static_cast<int>(end - start), [&](int k, int32_t id, int b, int e) {
        if (k < slots) {
          tok_id[at + k] = id;
          tok_begin[at + k] = static_cast<int32_t>(o[b] - base);
          tok_end[at + k] = static_cast<int32_t>(o[e - 1] + 1 - base);
        }
      });
    }
    if (count < 0) {  // one [UNK] for the whole word
      if (mode == 0) {
        tok_count[w] = 1;
      } else {
        const int64_t at = tok_pos[w];
        tok_id[at] = unk_id;
        tok_begin[at] = static_cast<int32_t>(orig[start] - base);
        tok_end[at] = static_cast<int32_t>(orig[end - 1] + 1 - base);
      }
    } else if (mode == 0) {
      tok_count[w] = count;
    }
  }
};

// ------------------------------------------------------------------------------------------------
// 5. Rows: [CLS] a [SEP] (b [SEP]) with the truncated lengths, then padding. One item per
//    (row, position < width); flat mode (row_offset given) writes rows back to back.
// ------------------------------------------------------------------------------------------------
struct Assemble {
  const int64_t* seg_tok_start;  // first token of each segment (n_segs + 1)
  const int32_t* tok_id;
  const int32_t* tok_begin;
  const int32_t* tok_end;
  const int64_t* len_a;
  const int64_t* len_b;          // -1: no pair
  const int64_t* total;
  const int64_t* row_offset;     // flat mode: where row r starts; padded mode: null
  int64_t* ids;
  int64_t* types;
  int64_t* mask;                 // padded mode only
  int64_t* offsets;              // null: not asked for
  int64_t rows, width, n_rows_a; // segment of row r's pair: n_rows_a + r
  int32_t add_special, cls_id, sep_id, pad_id;
  int64_t n;

  template <class Get>
  static Assemble make(Get& get) {
    const bool flat = get.scalar("flat") != 0;
    const bool with_offsets = get.scalar("with_offsets") != 0;
    const int64_t rows = get.scalar("rows"), width = get.scalar("width");
    return {get.template ptr<int64_t>("seg_tok_start"), get.template ptr<int32_t>("tok_id"),
            get.template ptr<int32_t>("tok_begin"), get.template ptr<int32_t>("tok_end"),
            get.template ptr<int64_t>("len_a"), get.template ptr<int64_t>("len_b"),
            get.template ptr<int64_t>("total"), flat ? get.template ptr<int64_t>("row_offset") : nullptr,
            get.template ptr<int64_t>("ids"), get.template ptr<int64_t>("types"),
            flat ? nullptr : get.template ptr<int64_t>("mask"),
            with_offsets ? get.template ptr<int64_t>("offsets") : nullptr, rows, width, rows,
            static_cast<int32_t>(get.scalar("add_special")), static_cast<int32_t>(get.scalar("cls_id")),
            static_cast<int32_t>(get.scalar("sep_id")), static_cast<int32_t>(get.scalar("pad_id")), rows * width};
  }

  FB_HD void operator()(int64_t i) const {
    const int64_t r = i / width, p = i % width;
    const int64_t la = len_a[r], lb = len_b[r], n_tok = total[r];
    if (row_offset && p >= n_tok) return;
    const int64_t at = row_offset ? row_offset[r] + p : i;
    int64_t id = pad_id, type = 0, begin = 0, end = 0;
    if (p < n_tok) {
      const int64_t sp = add_special ? 1 : 0;
      int64_t q = p;  // walk the template: [CLS] a [SEP] b [SEP]
      int64_t tok = -1;
      if (sp && q == 0) {
        id = cls_id;
      } else if ((q -= sp) < la) {
        tok = seg_tok_start[r] + q;
      } else if (sp && q == la) {
        id = sep_id;
      } else {
        type = 1;
        q -= la + sp;
        if (q < lb) tok = seg_tok_start[n_rows_a + r] + q;
        else id = sep_id;
      }
      if (tok >= 0) {
        id = tok_id[tok];
        begin = tok_begin[tok];
        end = tok_end[tok];
      }
    }
    ids[at] = id;
    types[at] = type;
    if (mask) mask[at] = p < n_tok ? 1 : 0;
    if (offsets) {
      offsets[2 * at] = begin;
      offsets[2 * at + 1] = end;
    }
  }
};

}  // namespace gpu
}  // namespace fastbert
