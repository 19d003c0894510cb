// BERT normalization tables: for one option set (lowercase, strip_accents, tokenize_chinese_chars),
// what HF's BertNormalizer turns each code point into, composed once from the generated Unicode
// data (gen_unicode.py) into a two-stage lookup table (see wordpiece_core.h for the entry format).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "wordpiece_core.h"

namespace fastbert {

struct NormOptions {
  bool lowercase = true;
  bool strip_accents = true;
  bool chinese = true;
  bool operator==(const NormOptions& o) const {
    return lowercase == o.lowercase && strip_accents == o.strip_accents && chinese == o.chinese;
  }
};

// ASCII fast path: the normalized byte and class of each ASCII character.
struct AsciiEntry {
  uint8_t byte;   // lowercased if asked
  uint8_t klass;  // kSep, kWord, kIsolated, or kAsciiRemoved
};
constexpr uint8_t kAsciiRemoved = 3;

class NormTable {
 public:
  std::vector<uint16_t> stage1;
  std::vector<uint32_t> stage2;
  std::vector<uint32_t> pool;
  AsciiEntry ascii[128];
  // NFD data for the canonical-reordering path (same for every option set).
  std::vector<uint32_t> dec_cp, dec_start, dec_len, dec_pool, ccc_lo, ccc_hi, ccc_val;
  NormOptions options;

  NormView view() const { return {stage1.data(), stage2.data(), pool.data()}; }
  NfdView nfd_view() const {
    return {dec_cp.data(), dec_start.data(), dec_len.data(), dec_pool.data(), static_cast<int32_t>(dec_cp.size()),
            ccc_lo.data(), ccc_hi.data(), ccc_val.data(), static_cast<int32_t>(ccc_lo.size())};
  }

  // Shared, cached per option set (building takes ~20 ms).
  static std::shared_ptr<const NormTable> get(const NormOptions& options);

 private:
  void build(const NormOptions& options);
};

// Version of the Unicode data the tables were generated from (Python's unicodedata at build time).
const char* unicode_version();

}  // namespace fastbert
