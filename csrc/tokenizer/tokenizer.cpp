// CPU tokenizer (tokenizer.h): the single pass over code points, batching, post-processing.
#include "tokenizer.h"

#include <algorithm>
#include <string>

#include "thread_pool.h"

namespace fastbert {

struct Tokenizer::Scratch {
  // cap: characters kept per word; a longer word is [UNK], only its span matters.
  explicit Scratch(int64_t cap)
      : cap(cap), bytes(4 * static_cast<size_t>(cap) + 8), orig(bytes.size()), run_cp(16), run_key(16) {}
  int64_t cap;
  std::vector<uint8_t> bytes;   // the current word, normalized, UTF-8 (first max_chars characters)
  std::vector<int64_t> orig;    // original character index of each byte
  std::vector<uint32_t> run_cp, run_key;  // canonical-reordering runs
  int64_t nb = 0, nchars = 0;
  int64_t nkeep = 0, nmarks = 0;  // characters with kReorder / kNonStarter since the last word boundary
  int64_t first = 0, last = 0;    // original index of the word's first and last normalized character

  // Canonical reordering in place (wordpiece_core.h) when the word keeps a non-starter that
  // another non-starter may be sorted against.
  template <typename CharT>
  void reorder(const NormTable& table, const CharT* s, int64_t n) {
    if (nkeep == 0 || nmarks < 2) return;
    for (;;) {
      const int r = reorder_word(table.view(), table.nfd_view(), [s](int64_t i) { return static_cast<uint32_t>(s[i]); },
                                 0, n, first, last, bytes.data(), orig.data(), run_cp.data(), run_key.data(),
                                 static_cast<int>(run_cp.size()));
      if (r >= 0) {
        nb = r;
        first = orig[0];  // a whole-word [UNK] spans the moved characters' offsets, as in HF
        last = orig[nb - 1];
        return;
      }
      run_cp.resize(2 * run_cp.size());  // a longer run of marks than ever before
      run_key.resize(run_cp.size());
    }
  }
};

// Word handler of encode_chars that WordPiece-tokenizes each word into a TokenSink.
struct Tokenizer::Emitter {
  const Tokenizer& tok;
  TokenSink& out;
  template <typename CharT>
  void word(const CharT* s, int64_t n, Scratch& w) { tok.finish_word(s, n, w, out); }
  void ascii_isolated(uint8_t byte, int64_t i) { out.push(tok.ascii_piece_[byte], i, i + 1); }
  void special(int32_t id, int64_t i, int64_t len) { out.push(id, i, i + len); }
};

// Word handler that keeps the normalized words (pre_tokenize).
struct Tokenizer::Collector {
  std::vector<PreToken>& out;
  const NormTable& table;
  template <typename CharT>
  void word(const CharT* s, int64_t n, Scratch& w) {
    w.reorder(table, s, n);
    out.push_back({std::string(reinterpret_cast<const char*>(w.bytes.data()), w.nb), w.first, w.last + 1});
  }
  void ascii_isolated(uint8_t byte, int64_t i) { out.push_back({std::string(1, static_cast<char>(byte)), i, i + 1}); }
  void special(int32_t, int64_t, int64_t) {}  // not reached: the collector runs without special tokens
};

Tokenizer::Tokenizer(const std::vector<std::string>& vocab, const TokenizerConfig& config)
    : config_(config), norm_(NormTable::get(config.norm)), trie_(vocab) {
  if (config_.unk_id < 0 || config_.unk_id >= static_cast<int32_t>(vocab.size()))
    throw std::invalid_argument("unk_id is not a valid token id");
  if (config_.max_input_chars_per_word < 1) throw std::invalid_argument("max_input_chars_per_word must be >= 1");
  std::sort(config_.specials.begin(), config_.specials.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });  // longest first
  std::fill(std::begin(special_first_), std::end(special_first_), false);
  for (const auto& sp : config_.specials) {
    if (sp.first.empty()) throw std::invalid_argument("empty special token");
    if (sp.first[0] < 128) special_first_[sp.first[0]] = true;
    else special_nonascii_ = true;
  }
  // One-character ASCII words (punctuation) skip the trie.
  const TrieView t = trie_.view();
  for (int c = 0; c < 128; ++c) {
    const uint8_t byte = static_cast<uint8_t>(c);
    int32_t piece = config_.unk_id;
    if (c == 0 || match_word(t, &byte, 1, [&](int, int32_t id, int, int) { piece = id; }) != 1)
      piece = config_.unk_id;
    ascii_piece_[c] = piece;
  }
}

template <typename CharT>
int64_t Tokenizer::match_special(const CharT* s, int64_t n, int64_t i, int32_t* id) const {
  for (const auto& sp : config_.specials) {  // longest first: HF's leftmost-longest match
    const std::u32string& t = sp.first;
    if (static_cast<int64_t>(t.size()) > n - i) continue;
    size_t k = 0;
    while (k < t.size() && static_cast<uint32_t>(s[i + k]) == t[k]) ++k;
    if (k == t.size()) {
      *id = sp.second;
      return static_cast<int64_t>(t.size());
    }
  }
  return 0;
}

template <typename CharT>
void Tokenizer::finish_word(const CharT* s, int64_t n, Scratch& w, TokenSink& out) const {
  const int32_t unk = config_.unk_id;
  if (w.nchars > config_.max_input_chars_per_word) {
    out.push(unk, w.first, w.last + 1);
    return;
  }
  w.reorder(*norm_, s, n);
  const int nb = static_cast<int>(w.nb);
  const int64_t base = out.size();
  const int64_t* orig = w.orig.data();
  const int k = match_word(trie_.view(), w.bytes.data(), nb,
                           [&](int, int32_t id, int b, int e) { out.push(id, orig[b], orig[e - 1] + 1); });
  if (k < 0) {
    out.truncate(base);
    out.push(unk, w.first, w.last + 1);
  }
}

template <typename CharT, typename Handler>
void Tokenizer::encode_chars(const CharT* s, int64_t n, Handler& handler, Scratch& w, bool specials) const {
  const NormTable& table = *norm_;
  const NormView nv = table.view();
  const AsciiEntry* ascii = table.ascii;
  const int64_t cap = w.cap;
  const bool* special_first = specials ? special_first_ : no_special_;
  const bool special_nonascii = specials && special_nonascii_;
  uint8_t* bytes = w.bytes.data();
  int64_t* orig = w.orig.data();
  int64_t nb = 0, nchars = 0, nkeep = 0, nmarks = 0;
  int64_t first = 0, last = 0;
  auto flush = [&]() {
    if (nchars > 0) {
      w.nb = nb;
      w.nchars = nchars;
      w.nkeep = nkeep;
      w.nmarks = nmarks;
      w.first = first;
      w.last = last;
      handler.word(s, n, w);
    }
    nb = nchars = nkeep = nmarks = 0;
  };
  auto push = [&](uint32_t cp, int64_t i) {
    if (nchars == 0) first = i;
    last = i;
    if (nchars < cap) {  // past the limit the word is [UNK]: only its span matters
      const int k = utf8_encode(cp, bytes + nb);
      for (int j = 0; j < k; ++j) orig[nb + j] = i;
      nb += k;
    }
    ++nchars;
  };
  auto special = [&](int64_t& i) {
    int32_t id;
    const int64_t len = match_special(s, n, i, &id);
    if (len == 0) return false;
    flush();
    handler.special(id, i, len);
    i += len - 1;
    return true;
  };
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t cp = s[i];
    if (cp < 128) {
      if (special_first[cp] && special(i)) continue;
      const AsciiEntry a = ascii[cp];
      if (a.klass == kWord) {
        if (nchars == 0) first = i;
        last = i;
        if (nchars < cap) {
          bytes[nb] = a.byte;
          orig[nb] = i;
          ++nb;
        }
        ++nchars;
      } else if (a.klass == kSep) {
        flush();
      } else if (a.klass == kIsolated) {
        flush();
        handler.ascii_isolated(a.byte, i);
      }
      continue;
    }
    if (special_nonascii && special(i)) continue;
    const uint32_t e = nv.lookup(cp);
    if (e & kIdentity) {
      const uint32_t klass = (e >> kClassShift) & 3;
      nkeep += (e & kReorder) != 0;
      nmarks += (e & kNonStarter) != 0;
      if (klass == kWord) {
        push(cp, i);
      } else if (klass == kSep) {
        flush();
      } else {
        flush();
        push(cp, i);
        flush();
      }
      continue;
    }
    if (e & kInvalid) throw EncodeError(i, cp);
    nkeep += (e & kReorder) != 0;
    nmarks += (e & kNonStarter) != 0;
    const uint32_t len = e & kLenMask, off = (e >> kOffsetShift) & kOffsetMask;
    for (uint32_t k = 0; k < len; ++k) {
      const uint32_t item = table.pool[off + k];
      const uint32_t c = item & kCpMask, klass = item >> kPoolClassShift;
      if (klass == kWord) {
        push(c, i);
      } else if (klass == kSep) {
        flush();
      } else {
        flush();
        push(c, i);
        flush();
      }
    }
  }
  flush();
}

template <typename Handler>
void Tokenizer::dispatch(const TextRef& t, Handler& handler, Scratch& w, bool specials) const {
  switch (t.kind) {
    case 1: encode_chars(static_cast<const uint8_t*>(t.data), t.length, handler, w, specials); break;
    case 2: encode_chars(static_cast<const uint16_t*>(t.data), t.length, handler, w, specials); break;
    case 4: encode_chars(static_cast<const uint32_t*>(t.data), t.length, handler, w, specials); break;
    default: throw std::invalid_argument("text kind must be 1, 2 or 4 bytes per code point");
  }
}

void Tokenizer::encode(const TextRef& text, TokenSink& out) const {
  Scratch w(config_.max_input_chars_per_word);
  Emitter emitter{*this, out};
  dispatch(text, emitter, w, true);
}

std::vector<PreToken> Tokenizer::pre_tokenize(const TextRef& text) const {
  std::vector<PreToken> words;
  Scratch w(text.length + 1);  // no length limit
  Collector collector{words, *norm_};
  dispatch(text, collector, w, false);
  return words;
}

BatchTokens Tokenizer::encode_batch(const std::vector<TextRef>& segments, int threads) const {
  const int64_t n = static_cast<int64_t>(segments.size());
  BatchTokens bt;
  bt.seg_sink.assign(n, 0);
  bt.seg_begin.assign(n, 0);
  bt.seg_count.assign(n, 0);
  // Contiguous chunks of about equal character counts, several per thread for load balance.
  int64_t total = 0;
  for (const auto& t : segments) total += t.length;
  const int64_t n_chunks = threads <= 1 ? 1 : std::max<int64_t>(1, std::min<int64_t>(n, 8LL * threads));
  std::vector<int64_t> bounds{0};
  int64_t acc = 0;
  for (int64_t s = 0; s < n; ++s) {
    acc += segments[s].length + 1;
    const int64_t chunk = static_cast<int64_t>(bounds.size());
    if (chunk < n_chunks && acc * n_chunks >= chunk * (total + n)) bounds.push_back(s + 1);
  }
  if (bounds.back() != n) bounds.push_back(n);
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  bt.sinks.resize(chunks);
  ThreadPool::instance().run(chunks, threads, [&](int64_t c) {
    Scratch w(config_.max_input_chars_per_word);
    // A local sink, moved into place at the end: sinks side by side in bt.sinks would share cache
    // lines, and every push_back would bounce them between cores.
    TokenSink sink;
    Emitter emitter{*this, sink};
    int64_t chars = 0;
    for (int64_t s = bounds[c]; s < bounds[c + 1]; ++s) chars += segments[s].length;
    sink.tokens.reserve(chars / 4 + 16);
    for (int64_t s = bounds[c]; s < bounds[c + 1]; ++s) {
      const int64_t begin = sink.size();
      const TextRef& t = segments[s];
      try {
        dispatch(t, emitter, w, true);
      } catch (EncodeError& e) {
        e.text = s;
        throw;
      }
      bt.seg_sink[s] = static_cast<int32_t>(c);
      bt.seg_begin[s] = begin;
      bt.seg_count[s] = sink.size() - begin;
    }
    bt.sinks[c] = std::move(sink);
  });
  return bt;
}

// ------------------------------------------------------------------------------------------------
// Post-processing
// ------------------------------------------------------------------------------------------------

namespace {

// HF tokenizers' truncate_encodings for a budget of `budget` tokens (special tokens excluded).
void truncate_lengths(int64_t& a, int64_t& b, int64_t budget, PostOptions::Strategy strategy, int64_t row) {
  if (b < 0) {  // single text
    a = std::min(a, budget);
    return;
  }
  if (a + b <= budget) return;
  if (budget == 0) {  // HF empties both sequences, whatever the strategy
    a = b = 0;
    return;
  }
  if (strategy == PostOptions::kLongestFirst) {
    // The shorter keeps its length if the longer can absorb the cut; otherwise both get half.
    int64_t n1 = std::min(a, b), n2 = std::max(a, b);
    n2 = n1 > budget ? n1 : std::max(n1, budget - n1);
    if (n1 + n2 > budget) {
      n1 = budget / 2;
      n2 = n1 + budget % 2;
    }
    if (a > b) {
      a = n2;
      b = n1;
    } else {
      a = n1;
      b = n2;
    }
    return;
  }
  const int64_t to_remove = a + b - budget;
  int64_t& target = strategy == PostOptions::kOnlyFirst ? a : b;
  if (target <= to_remove) {  // HF refuses to empty one sequence entirely
    const char* which = strategy == PostOptions::kOnlyFirst ? "first" : "second";
    const char* name = strategy == PostOptions::kOnlyFirst ? "only_first" : "only_second";
    throw std::invalid_argument("truncation='" + std::string(name) + "' cannot fit max_length: the " + which +
                                " sequence of row " + std::to_string(row) + " has " + std::to_string(target) +
                                " tokens but " + std::to_string(to_remove) +
                                " must go; use truncation='longest_first' or a larger max_length");
  }
  target -= to_remove;
}

}  // namespace

RowLayout Tokenizer::layout(const BatchTokens& tokens, const std::vector<int64_t>& first,
                            const std::vector<int64_t>& second, const PostOptions& post) const {
  return row_layout(tokens.seg_count.data(), first, second, post);
}

RowLayout row_layout(const int64_t* seg_count, const std::vector<int64_t>& first, const std::vector<int64_t>& second,
                     const PostOptions& post) {
  const int64_t rows = static_cast<int64_t>(first.size());
  RowLayout out;
  out.len_a.resize(rows);
  out.len_b.resize(rows);
  out.total.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t a = seg_count[first[r]];
    int64_t b = second[r] >= 0 ? seg_count[second[r]] : -1;
    const int64_t n_special = post.add_special_tokens ? (b >= 0 ? 3 : 2) : 0;
    if (post.strategy != PostOptions::kNone && post.max_length >= 0) {
      const int64_t budget = post.max_length - n_special;
      if (budget < 0)
        throw std::invalid_argument("max_length=" + std::to_string(post.max_length) + " is too short for the " +
                                    std::to_string(n_special) + " special tokens [CLS]/[SEP]; use max_length >= " +
                                    std::to_string(n_special));
      truncate_lengths(a, b, budget, post.strategy, r);
    }
    out.len_a[r] = a;
    out.len_b[r] = b;
    out.total[r] = a + std::max<int64_t>(b, 0) + n_special;
    out.longest = std::max(out.longest, out.total[r]);
  }
  return out;
}

void Tokenizer::write_row(const BatchTokens& tokens, int64_t a, int64_t b, int64_t len_a, int64_t len_b,
                          const PostOptions& post, int64_t* ids, int64_t* types, int64_t* offsets) const {
  int64_t p = 0;
  auto special = [&](int32_t id, int64_t type) {
    ids[p] = id;
    types[p] = type;
    if (offsets) offsets[2 * p] = offsets[2 * p + 1] = 0;
    ++p;
  };
  auto copy = [&](int64_t seg, int64_t len, int64_t type) {
    const TokenSink& sink = tokens.sink(seg);
    const int64_t begin = tokens.seg_begin[seg];
    for (int64_t k = 0; k < len; ++k, ++p) {
      const Token& t = sink.tokens[begin + k];
      ids[p] = t.id;
      types[p] = type;
      if (offsets) {
        offsets[2 * p] = t.start;
        offsets[2 * p + 1] = t.end;
      }
    }
  };
  if (post.add_special_tokens) special(post.cls_id, 0);
  copy(a, len_a, 0);
  if (post.add_special_tokens) special(post.sep_id, 0);
  if (b >= 0) {
    copy(b, len_b, 1);
    if (post.add_special_tokens) special(post.sep_id, 1);
  }
}

void Tokenizer::fill_padded(const BatchTokens& tokens, const std::vector<int64_t>& first,
                            const std::vector<int64_t>& second, const RowLayout& layout, const PostOptions& post,
                            int64_t width, int64_t* ids, int64_t* types, int64_t* mask, int64_t* offsets,
                            int threads) const {
  const int64_t rows = static_cast<int64_t>(first.size());
  const int64_t per_task = 256;
  ThreadPool::instance().run((rows + per_task - 1) / per_task, threads, [&](int64_t task) {
    for (int64_t r = task * per_task; r < std::min(rows, (task + 1) * per_task); ++r) {
      int64_t* row_ids = ids + r * width;
      int64_t* row_types = types + r * width;
      int64_t* row_mask = mask + r * width;
      int64_t* row_off = offsets ? offsets + 2 * r * width : nullptr;
      write_row(tokens, first[r], second[r], layout.len_a[r], layout.len_b[r], post, row_ids, row_types, row_off);
      const int64_t n = layout.total[r];
      std::fill(row_mask, row_mask + n, 1);
      std::fill(row_mask + n, row_mask + width, 0);
      std::fill(row_ids + n, row_ids + width, post.pad_id);
      std::fill(row_types + n, row_types + width, 0);
      if (row_off) std::fill(row_off + 2 * n, row_off + 2 * width, 0);
    }
  });
}

void Tokenizer::fill_flat(const BatchTokens& tokens, const std::vector<int64_t>& first,
                          const std::vector<int64_t>& second, const RowLayout& layout, const PostOptions& post,
                          int64_t* row_splits, int64_t* ids, int64_t* types, int64_t* offsets, int threads) const {
  const int64_t rows = static_cast<int64_t>(first.size());
  row_splits[0] = 0;
  for (int64_t r = 0; r < rows; ++r) row_splits[r + 1] = row_splits[r] + layout.total[r];
  const int64_t per_task = 256;
  ThreadPool::instance().run((rows + per_task - 1) / per_task, threads, [&](int64_t task) {
    for (int64_t r = task * per_task; r < std::min(rows, (task + 1) * per_task); ++r) {
      const int64_t at = row_splits[r];
      write_row(tokens, first[r], second[r], layout.len_a[r], layout.len_b[r], post, ids + at, types + at,
                offsets ? offsets + 2 * at : nullptr);
    }
  });
}

}  // namespace fastbert
