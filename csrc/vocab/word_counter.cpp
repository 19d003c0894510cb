// Multithreaded word counting: see word_counter.h.
#include "word_counter.h"

#include <algorithm>
#include <stdexcept>
#include <thread>

namespace fastbert::vocab {

namespace {

constexpr char32_t kMaxCodePoint = 0x10FFFF;
constexpr char32_t kReplacement = 0xFFFD;

// WikiExtractor wraps articles in <doc id="..." url="..." title="..."> ... </doc> lines.
bool is_markup_line(std::string_view line) {
  while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.remove_suffix(1);
  if (line == "</doc>") return true;
  return line.size() >= 5 && line.substr(0, 4) == "<doc" && (line[4] == ' ' || line[4] == '>') &&
         line.back() == '>';
}

}  // namespace

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

char32_t next_code_point(std::string_view text, size_t& i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  int len = 0;
  char32_t cp = 0;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2, cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, cp = b0 & 0x07;
  } else {
    ++i;
    return kReplacement;
  }
  if (i + len > text.size()) {
    ++i;
    return kReplacement;
  }
  for (int k = 1; k < len; ++k) {
    const unsigned char b = byte(i + k);
    if ((b & 0xC0) != 0x80) {
      ++i;
      return kReplacement;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  i += len;
  // Overlong forms, surrogates and values past U+10FFFF are not valid UTF-8.
  static constexpr char32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinForLength[len] || cp > kMaxCodePoint || (cp >= 0xD800 && cp <= 0xDFFF)) return kReplacement;
  return cp;
}

WordCounter::WordCounter(int num_threads)
    : num_threads_(num_threads > 0 ? num_threads : std::max(1u, std::thread::hardware_concurrency())),
      table_(kMaxCodePoint + 1, kUnknown),
      shards_(num_threads_) {}

std::vector<char32_t> WordCounter::missing(std::string_view text) const {
  std::vector<bool> seen(kMaxCodePoint + 1, false);
  std::vector<char32_t> out;
  for (size_t i = 0; i < text.size();) {
    const char32_t cp = next_code_point(text, i);
    if (table_[cp] == kUnknown && !seen[cp]) {
      seen[cp] = true;
      out.push_back(cp);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void WordCounter::set_char(char32_t cp, std::vector<NormalizedChar> out) {
  if (cp > kMaxCodePoint) throw std::invalid_argument("code point out of range");
  for (const auto& c : out) {
    if (c.cp > kMaxCodePoint || c.kind > kSpace) throw std::invalid_argument("bad normalized character");
  }
  if (out.empty()) {
    table_[cp] = kDrop;
  } else if (out.size() == 1) {
    table_[cp] = (static_cast<uint32_t>(out[0].cp) << 2) | out[0].kind;
  } else {
    table_[cp] = kComplex | static_cast<uint32_t>(entries_.size());
    entries_.push_back(std::move(out));
  }
}

void WordCounter::count_range(std::string_view text, WordCounts& counts, uint64_t& lines,
                              uint64_t& words) const {
  std::string word;
  const auto flush = [&] {
    if (!word.empty()) {
      ++counts[word];
      ++words;
      word.clear();
    }
  };
  const auto emit = [&](char32_t cp, uint32_t kind) {
    if (kind == kWord) {
      append_utf8(word, cp);
      return;
    }
    flush();
    if (kind == kIsolated) {
      append_utf8(word, cp);
      flush();
    }
  };
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(start, end - start);
    start = end + 1;
    ++lines;
    if (!line.empty() && line[0] == '<' && is_markup_line(line)) continue;
    for (size_t i = 0; i < line.size();) {
      const char32_t cp = next_code_point(line, i);
      const uint32_t entry = table_[cp];
      if (entry < kComplex) {
        emit(entry >> 2, entry & 3);
      } else if (entry == kUnknown) {
        throw std::logic_error("code point without normalization entry (call missing/set_char first)");
      } else if (entry != kDrop) {
        for (const NormalizedChar& c : entries_[entry & ~kComplex]) emit(c.cp, c.kind);
      }
    }
    flush();  // a line end is a word boundary
  }
}

void WordCounter::add(std::string_view text) {
  bytes_ += text.size();
  // Cut the text into one slice per thread, at line ends.
  const size_t n = static_cast<size_t>(num_threads_);
  std::vector<std::string_view> slices;
  size_t begin = 0;
  for (size_t t = 0; t < n && begin < text.size(); ++t) {
    size_t end = t + 1 == n ? text.size() : std::max(begin, text.size() * (t + 1) / n);
    if (end < text.size()) {
      const size_t newline = text.find('\n', end);
      end = newline == std::string_view::npos ? text.size() : newline + 1;
    }
    slices.push_back(text.substr(begin, end - begin));
    begin = end;
  }
  std::vector<uint64_t> lines(slices.size(), 0), words(slices.size(), 0);
  std::vector<std::string> errors(slices.size());
  const auto work = [&](size_t t) {
    try {
      count_range(slices[t], shards_[t], lines[t], words[t]);
    } catch (const std::exception& e) {
      errors[t] = e.what();
    }
  };
  if (slices.size() == 1) {
    work(0);
  } else {
    std::vector<std::thread> threads;
    for (size_t t = 0; t < slices.size(); ++t) threads.emplace_back(work, t);
    for (auto& th : threads) th.join();
  }
  for (const auto& e : errors) {
    if (!e.empty()) throw std::runtime_error(e);
  }
  for (size_t t = 0; t < slices.size(); ++t) lines_ += lines[t], words_ += words[t];
}

WordCounts WordCounter::take_counts() {
  // Merge into the largest shard.
  size_t largest = 0;
  for (size_t t = 1; t < shards_.size(); ++t) {
    if (shards_[t].size() > shards_[largest].size()) largest = t;
  }
  WordCounts out = std::move(shards_[largest]);
  for (size_t t = 0; t < shards_.size(); ++t) {
    if (t == largest) continue;
    for (auto& [word, count] : shards_[t]) out[word] += count;
    WordCounts().swap(shards_[t]);
  }
  shards_.assign(num_threads_, WordCounts());
  return out;
}

}  // namespace fastbert::vocab
