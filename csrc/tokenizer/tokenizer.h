// The CPU WordPiece tokenizer: one pass over a text's code points (normalize, pre-tokenize, match
// special tokens, WordPiece each word as soon as it ends), batches on the thread pool, and the
// post-processing of HF's BERT template ([CLS] A [SEP] (B [SEP]), truncation, padding).
// Texts come in as Python's internal string storage (1, 2 or 4 bytes per code point), so offsets
// are code point indices, as HF's offset_mapping.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "normalizer.h"
#include "trie.h"

namespace fastbert {

struct TextRef {
  const void* data = nullptr;
  int64_t length = 0;  // code points
  int kind = 1;        // bytes per code point: 1, 2 or 4
};

// Tokens of one or more texts, without special tokens: id and [start, end) code point offsets.
struct Token {
  int32_t id, start, end;
};
struct TokenSink {
  std::vector<Token> tokens;
  int64_t size() const { return static_cast<int64_t>(tokens.size()); }
  void push(int32_t id, int64_t start, int64_t end) {
    tokens.push_back(Token{id, static_cast<int32_t>(start), static_cast<int32_t>(end)});
  }
  void truncate(int64_t n) { tokens.resize(n); }
};

// A normalized word and the [start, end) code points it spans in the original text.
struct PreToken {
  std::string word;  // UTF-8
  int64_t start, end;
};

// A text that cannot be encoded (a lone surrogate). `text` is filled in by batch callers.
struct EncodeError : std::runtime_error {
  EncodeError(int64_t position, uint32_t cp) : std::runtime_error("lone surrogate"), position(position), cp(cp) {}
  int64_t text = -1;
  int64_t position;
  uint32_t cp;
};

struct TokenizerConfig {
  NormOptions norm;
  int max_input_chars_per_word = 100;
  int32_t unk_id = -1;
  // Special tokens matched as whole strings in the raw text (HF's added tokens), with their ids.
  std::vector<std::pair<std::u32string, int32_t>> specials;
};

// Tokens of a batch of texts ("segments"), tokenized in chunks on the thread pool.
struct BatchTokens {
  std::vector<TokenSink> sinks;       // one per chunk
  std::vector<int32_t> seg_sink;      // segment -> its chunk
  std::vector<int64_t> seg_begin;     // segment -> first token in that chunk's sink
  std::vector<int64_t> seg_count;     // segment -> number of tokens
  const TokenSink& sink(int64_t seg) const { return sinks[seg_sink[seg]]; }
};

// Post-processing options (HF TemplateProcessing + truncation + padding).
struct PostOptions {
  bool add_special_tokens = true;
  int64_t max_length = -1;  // -1: none
  enum Strategy { kNone = 0, kLongestFirst = 1, kOnlyFirst = 2, kOnlySecond = 3 } strategy = kNone;
  int32_t cls_id = -1, sep_id = -1, pad_id = 0;
};

// Per-row lengths after truncation.
struct RowLayout {
  std::vector<int64_t> len_a, len_b, total;  // len_b = -1 without a pair
  int64_t longest = 0;
};

// Row lengths after HF truncation, from each segment's token count.
RowLayout row_layout(const int64_t* seg_count, const std::vector<int64_t>& first, const std::vector<int64_t>& second,
                     const PostOptions& post);

class Tokenizer {
 public:
  Tokenizer(const std::vector<std::string>& vocab, const TokenizerConfig& config);

  // Appends the tokens of one text to `out`. Throws EncodeError.
  void encode(const TextRef& text, TokenSink& out) const;
  // Normalization + pre-tokenization only (no special tokens, no length limit): HF's
  // normalizer + pre-tokenizer splits. Throws EncodeError.
  std::vector<PreToken> pre_tokenize(const TextRef& text) const;
  BatchTokens encode_batch(const std::vector<TextRef>& segments, int threads) const;

  // rows: segment index of each row's first text and of its pair (-1: none).
  RowLayout layout(const BatchTokens& tokens, const std::vector<int64_t>& first, const std::vector<int64_t>& second,
                   const PostOptions& post) const;
  // Writes rows padded to `width` (pad id, type 0, mask 0, offsets (0, 0)); offsets may be null.
  void fill_padded(const BatchTokens& tokens, const std::vector<int64_t>& first, const std::vector<int64_t>& second,
                   const RowLayout& layout, const PostOptions& post, int64_t width, int64_t* ids, int64_t* types,
                   int64_t* mask, int64_t* offsets, int threads) const;
  // Writes rows back to back; row r starts at row_splits[r] (size rows + 1, filled here).
  void fill_flat(const BatchTokens& tokens, const std::vector<int64_t>& first, const std::vector<int64_t>& second,
                 const RowLayout& layout, const PostOptions& post, int64_t* row_splits, int64_t* ids, int64_t* types,
                 int64_t* offsets, int threads) const;

  const NormTable& norm() const { return *norm_; }
  const WordPieceTrie& trie() const { return trie_; }
  const TokenizerConfig& config() const { return config_; }

 private:
  struct Scratch;
  struct Emitter;
  struct Collector;
  template <typename CharT, typename Handler>
  void encode_chars(const CharT* s, int64_t n, Handler& handler, Scratch& w, bool specials) const;
  template <typename Handler>
  void dispatch(const TextRef& text, Handler& handler, Scratch& w, bool specials) const;
  template <typename CharT>
  int64_t match_special(const CharT* s, int64_t n, int64_t i, int32_t* id) const;
  template <typename CharT>
  void finish_word(const CharT* s, int64_t n, Scratch& w, TokenSink& out) const;
  void write_row(const BatchTokens& tokens, int64_t a, int64_t b, int64_t len_a, int64_t len_b,
                 const PostOptions& post, int64_t* ids, int64_t* types, int64_t* offsets) const;

  TokenizerConfig config_;
  std::shared_ptr<const NormTable> norm_;
  WordPieceTrie trie_;
  int32_t ascii_piece_[128];   // id of a one-character ASCII word (punctuation), or [UNK]
  bool special_first_[128];    // ASCII characters that start a special token
  bool special_nonascii_ = false;
  bool no_special_[128] = {};  // special_first_ with special-token matching off
};

}  // namespace fastbert
