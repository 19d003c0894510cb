// Multithreaded word counting for the WordPiece vocabulary trainer.
//
// The text is split into words exactly as the BERT basic tokenizer does it. The normalization of
// each code point (dropped, whitespace, punctuation / CJK isolated, lowercased, accent-stripped)
// is not computed here: the Python reference tokenizer fills the table (set_char) for the code
// points that `missing` reports, so both always agree and no Unicode table is hand-typed.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace fastbert::vocab {

// Kind of a normalized character, as in fastbert/tokenization/reference.py.
enum CharKind : uint8_t { kWord = 0, kIsolated = 1, kSpace = 2 };

struct NormalizedChar {
  char32_t cp;
  CharKind kind;
};

using WordCounts = std::unordered_map<std::string, uint64_t>;

// Appends the UTF-8 encoding of cp to out.
void append_utf8(std::string& out, char32_t cp);
// Decodes the code point at text[i], advancing i; invalid bytes decode to U+FFFD.
char32_t next_code_point(std::string_view text, size_t& i);

class WordCounter {
 public:
  explicit WordCounter(int num_threads);

  // Sorted, distinct code points of text whose normalization is not in the table yet.
  std::vector<char32_t> missing(std::string_view text) const;
  // Sets the normalization of one code point: the characters it becomes (none = dropped).
  void set_char(char32_t cp, std::vector<NormalizedChar> out);
  // Counts the words of every line of text (UTF-8), in parallel. Lines of WikiExtractor markup
  // ("<doc id=...>" and "</doc>") are skipped. Throws if a code point is missing from the table.
  void add(std::string_view text);
  // All counts so far, merged over threads; the counter is empty afterwards.
  WordCounts take_counts();

  uint64_t bytes() const { return bytes_; }
  uint64_t lines() const { return lines_; }
  uint64_t words() const { return words_; }
  int num_threads() const { return num_threads_; }

 private:
  void count_range(std::string_view text, WordCounts& counts, uint64_t& lines, uint64_t& words) const;

  // Per code point: kUnknown, kDrop, (normalized code point << 2 | kind) when it becomes one
  // character (nearly all), or kComplex | index into entries_.
  static constexpr uint32_t kUnknown = 0xFFFFFFFFu, kDrop = 0xFFFFFFFEu, kComplex = 0x80000000u;
  int num_threads_;
  std::vector<uint32_t> table_;
  std::vector<std::vector<NormalizedChar>> entries_;
  std::vector<WordCounts> shards_;  // one per thread, kept across add() calls
  uint64_t bytes_ = 0, lines_ = 0, words_ = 0;
};

}  // namespace fastbert::vocab
