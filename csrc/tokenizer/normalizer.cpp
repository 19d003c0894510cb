// Composes the generated Unicode data into the per-options normalization table (normalizer.h).
// Order of HF's BertNormalizer: clean_text (drop controls, whitespace -> " "), CJK spacing,
// strip_accents (NFD, drop Mn), lowercase (per character, Rust's char::to_lowercase).
#include "normalizer.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "unicode_data.h"  // generated at build time into csrc/tokenizer/generated/

namespace fastbert {
namespace {

constexpr uint32_t kNumCodePoints = 0x110000;
enum Prop : uint8_t { kPropControl = 1, kPropSpace = 2, kPropPunct = 4, kPropMark = 8, kPropChinese = 16 };

template <size_t N>
void mark(std::vector<uint8_t>& props, const unicode_data::Range (&ranges)[N], uint8_t bit) {
  for (const auto& r : ranges)
    for (uint32_t cp = r.lo; cp <= r.hi; ++cp) props[cp] |= bit;
}

// Binary search in a sorted generated mapping table; nullptr if cp is not there.
template <size_t N>
const unicode_data::Mapping* find_mapping(const unicode_data::Mapping (&table)[N], uint32_t cp) {
  auto it = std::lower_bound(std::begin(table), std::end(table), cp,
                             [](const unicode_data::Mapping& m, uint32_t c) { return m.cp < c; });
  return (it != std::end(table) && it->cp == cp) ? it : nullptr;
}

uint32_t combining_class(uint32_t cp) {
  const auto& t = unicode_data::k_combining_class;
  auto it = std::upper_bound(std::begin(t), std::end(t), cp,
                             [](uint32_t c, const unicode_data::ClassRange& r) { return c < r.lo; });
  if (it == std::begin(t)) return 0;
  --it;
  return (cp <= it->hi) ? it->ccc : 0;
}

}  // namespace

const char* unicode_version() { return unicode_data::kUnicodeVersion; }

void NormTable::build(const NormOptions& opts) {
  using namespace unicode_data;
  options = opts;
  std::vector<uint8_t> props(kNumCodePoints, 0);
  mark(props, k_control, kPropControl);
  mark(props, k_whitespace, kPropSpace);
  mark(props, k_punctuation, kPropPunct);
  mark(props, k_nonspacing_mark, kPropMark);
  mark(props, k_chinese, kPropChinese);

  NfdView nfd{};  // decomposition through the generated tables, Hangul algorithmically
  for (const auto& m : k_decomposition) {
    dec_cp.push_back(m.cp);
    dec_start.push_back(m.start);
    dec_len.push_back(m.len);
  }
  dec_pool.assign(std::begin(k_mapping_pool), std::end(k_mapping_pool));
  for (const auto& r : k_combining_class) {
    ccc_lo.push_back(r.lo);
    ccc_hi.push_back(r.hi);
    ccc_val.push_back(r.ccc);
  }
  nfd = nfd_view();

  std::vector<uint32_t> entries(kNumCodePoints);
  pool.clear();
  for (uint32_t cp = 0; cp < kNumCodePoints; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) {
      entries[cp] = kInvalid;
      continue;
    }
    const uint8_t p = props[cp];
    if (p & kPropControl) {  // includes U+0000 and U+FFFD
      entries[cp] = kControl;
      continue;
    }
    if (p & kPropSpace) {
      entries[cp] = kIdentity | (kSep << kClassShift);
      continue;
    }
    uint32_t seq[16];
    int n = 0;
    bool keeps_nonstarter = false, nonstarter = false;
    if (opts.strip_accents) {
      uint32_t dec[4];
      int m = nfd.decompose(cp, dec);
      for (int k = 0; k < m; ++k) {
        const bool ns = combining_class(dec[k]) != 0;
        nonstarter |= ns;
        if (props[dec[k]] & kPropMark) continue;
        keeps_nonstarter |= ns;
        seq[n++] = dec[k];
      }
    } else {
      seq[n++] = cp;
    }
    if (opts.lowercase) {
      uint32_t lowered[16];
      int m = 0;
      for (int k = 0; k < n; ++k) {
        const Mapping* low = find_mapping(k_lowercase, seq[k]);
        if (!low) {
          lowered[m++] = seq[k];
        } else {
          for (uint32_t j = 0; j < low->len; ++j) lowered[m++] = k_mapping_pool[low->start + j];
        }
      }
      std::memcpy(seq, lowered, sizeof(uint32_t) * m);
      n = m;
    }
    uint32_t classes[16];
    for (int k = 0; k < n; ++k) classes[k] = (props[seq[k]] & kPropPunct) ? kIsolated : kWord;
    const bool chinese = opts.chinese && (p & kPropChinese);
    if (chinese && n == 1) classes[0] = kIsolated;  // " X " is X on its own
    const uint32_t flags = (keeps_nonstarter ? kReorder : 0) | (nonstarter ? kNonStarter : 0);
    if (n == 1 && seq[0] == cp) {
      entries[cp] = kIdentity | (classes[0] << kClassShift) | flags;
      continue;
    }
    const uint32_t offset = static_cast<uint32_t>(pool.size());
    if (chinese && n != 1) pool.push_back(' ' | (kSep << kPoolClassShift));
    for (int k = 0; k < n; ++k) pool.push_back(seq[k] | (classes[k] << kPoolClassShift));
    if (chinese && n != 1) pool.push_back(' ' | (kSep << kPoolClassShift));
    const uint32_t len = static_cast<uint32_t>(pool.size()) - offset;
    if (len > kLenMask || offset > kOffsetMask) throw std::runtime_error("normalization table overflow");
    entries[cp] = (offset << kOffsetShift) | len | flags;
  }
  if (pool.empty()) pool.push_back(0);  // keep pool.data() valid for device copies

  // Two-stage table: identical 128-entry blocks are stored once.
  const uint32_t block = 1u << kBlockShift;
  stage1.assign(kNumCodePoints >> kBlockShift, 0);
  stage2.clear();
  std::unordered_map<std::string, uint16_t> seen;
  for (uint32_t b = 0; b < (kNumCodePoints >> kBlockShift); ++b) {
    std::string key(reinterpret_cast<const char*>(&entries[b * block]), block * sizeof(uint32_t));
    auto it = seen.find(key);
    if (it == seen.end()) {
      const uint16_t id = static_cast<uint16_t>(stage2.size() / block);
      it = seen.emplace(std::move(key), id).first;
      stage2.insert(stage2.end(), entries.begin() + b * block, entries.begin() + (b + 1) * block);
    }
    stage1[b] = it->second;
  }

  for (uint32_t cp = 0; cp < 128; ++cp) {
    const uint32_t e = entries[cp];
    if (e & kIdentity) {
      ascii[cp] = {static_cast<uint8_t>(cp), static_cast<uint8_t>((e >> kClassShift) & 3)};
    } else if ((e & kLenMask) == 1) {
      const uint32_t item = pool[(e >> kOffsetShift) & kOffsetMask];
      ascii[cp] = {static_cast<uint8_t>(item & kCpMask), static_cast<uint8_t>(item >> kPoolClassShift)};
    } else {
      ascii[cp] = {0, kAsciiRemoved};
    }
  }
}

std::shared_ptr<const NormTable> NormTable::get(const NormOptions& options) {
  static std::mutex mutex;
  static std::vector<std::shared_ptr<const NormTable>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& t : cache)
    if (t->options == options) return t;
  auto table = std::make_shared<NormTable>();
  table->build(options);
  cache.push_back(table);
  return table;
}

}  // namespace fastbert
