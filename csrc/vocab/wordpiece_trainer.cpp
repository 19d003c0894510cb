// WordPiece training by likelihood: see wordpiece_trainer.h.
#include "wordpiece_trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "word_counter.h"

namespace fastbert::vocab {

namespace {

using Key = uint64_t;  // a pair of symbol ids: left << 32 | right
inline Key make_key(uint32_t a, uint32_t b) { return (static_cast<Key>(a) << 32) | b; }
inline uint32_t left_of(Key k) { return static_cast<uint32_t>(k >> 32); }
inline uint32_t right_of(Key k) { return static_cast<uint32_t>(k); }

struct PairInfo {
  int64_t count = 0;
  std::vector<uint32_t> words;  // words that contain (or once contained) the pair
};

struct HeapEntry {
  double score;
  int64_t count;
  uint32_t a, b;
};

// Max-heap order: higher score, then higher count, then lower ids (older symbols) first.
inline bool operator<(const HeapEntry& x, const HeapEntry& y) {
  if (x.score != y.score) return x.score < y.score;
  if (x.count != y.count) return x.count < y.count;
  if (x.a != y.a) return x.a > y.a;
  return x.b > y.b;
}

class Trainer {
 public:
  Trainer(const TrainOptions& options, const ProgressFn& progress) : opt_(options), progress_(progress) {}

  TrainResult run(std::vector<std::pair<std::string, uint64_t>> words);

 private:
  uint32_t symbol(const std::string& s);
  double score(int64_t count, uint32_t a, uint32_t b) const {
    // Exact integer product: counts stay far below 2^32 each for any real corpus.
    const double ratio = static_cast<double>(count) /
                         static_cast<double>(static_cast<uint64_t>(sym_count_[a]) * static_cast<uint64_t>(sym_count_[b]));
    if (opt_.score == Score::kRatio) return ratio;
    // First-order change of the unigram log-likelihood when ab becomes one symbol.
    return static_cast<double>(count) * (std::log(ratio * static_cast<double>(total_)) - 1.0);
  }
  void push(Key k, const PairInfo& p) {
    if (p.count < static_cast<int64_t>(opt_.min_frequency)) return;
    heap_.push_back({score(p.count, left_of(k), right_of(k)), p.count, left_of(k), right_of(k)});
    std::push_heap(heap_.begin(), heap_.end());
  }
  void register_pair(Key k) {
    sym_pairs_[left_of(k)].push_back(k);
    if (left_of(k) != right_of(k)) sym_pairs_[right_of(k)].push_back(k);
  }
  void rebuild_heap();
  void merge(uint32_t a, uint32_t b, uint32_t c);

  const TrainOptions& opt_;
  const ProgressFn& progress_;
  std::vector<std::string> sym_str_;
  std::unordered_map<std::string, uint32_t> sym_id_;
  std::vector<int64_t> sym_count_;
  std::vector<std::vector<Key>> sym_pairs_;  // pairs containing each symbol (may hold dead or repeated keys)
  std::vector<std::vector<uint32_t>> segs_;  // current split of each word into symbols
  std::vector<uint64_t> word_count_;
  std::vector<uint32_t> word_stamp_;
  uint32_t stamp_ = 0;
  std::unordered_map<Key, PairInfo> pairs_;  // live pairs only (count > 0)
  std::vector<HeapEntry> heap_;
  std::unordered_map<Key, int64_t> delta_;
  int64_t total_ = 0;  // symbols in the corpus (sum of sym_count_); shrinks with every merge
};

uint32_t Trainer::symbol(const std::string& s) {
  auto it = sym_id_.find(s);
  if (it != sym_id_.end()) return it->second;
  const auto id = static_cast<uint32_t>(sym_str_.size());
  sym_id_.emplace(s, id);
  sym_str_.push_back(s);
  sym_count_.push_back(0);
  sym_pairs_.emplace_back();
  return id;
}

void Trainer::rebuild_heap() {
  heap_.clear();
  for (const auto& [k, p] : pairs_) {
    if (p.count >= static_cast<int64_t>(opt_.min_frequency))
      heap_.push_back({score(p.count, left_of(k), right_of(k)), p.count, left_of(k), right_of(k)});
  }
  std::make_heap(heap_.begin(), heap_.end());
}

void Trainer::merge(uint32_t a, uint32_t b, uint32_t c) {
  auto found = pairs_.find(make_key(a, b));
  const std::vector<uint32_t> words = std::move(found->second.words);
  delta_.clear();
  std::vector<std::pair<Key, uint32_t>> appeared;  // (pair with c, word) to add to the word index
  ++stamp_;
  std::vector<uint32_t> next;
  for (const uint32_t w : words) {
    if (word_stamp_[w] == stamp_) continue;  // listed twice
    word_stamp_[w] = stamp_;
    std::vector<uint32_t>& seg = segs_[w];
    const auto wc = static_cast<int64_t>(word_count_[w]);
    next.clear();
    int64_t occurrences = 0;
    for (size_t i = 0; i < seg.size(); ++i) {
      if (i + 1 < seg.size() && seg[i] == a && seg[i + 1] == b) {
        next.push_back(c);
        ++occurrences;
        ++i;
      } else {
        next.push_back(seg[i]);
      }
    }
    if (occurrences == 0) continue;  // the index entry is stale
    for (size_t i = 0; i + 1 < seg.size(); ++i) delta_[make_key(seg[i], seg[i + 1])] -= wc;
    for (size_t i = 0; i + 1 < next.size(); ++i) {
      const Key k = make_key(next[i], next[i + 1]);
      delta_[k] += wc;
      if (next[i] == c || next[i + 1] == c) appeared.emplace_back(k, w);
    }
    sym_count_[a] -= occurrences * wc;
    sym_count_[b] -= occurrences * wc;
    sym_count_[c] += occurrences * wc;
    total_ -= occurrences * wc;
    seg.swap(next);
  }

  std::vector<Key> rescore;
  for (const auto& [k, d] : delta_) {
    if (d == 0) continue;
    auto it = pairs_.find(k);
    if (it == pairs_.end()) {
      it = pairs_.emplace(k, PairInfo()).first;
      register_pair(k);
    }
    it->second.count += d;
    if (it->second.count <= 0) {
      pairs_.erase(it);
    } else {
      rescore.push_back(k);
    }
  }
  pairs_.erase(make_key(a, b));  // every occurrence was merged
  for (const auto& [k, w] : appeared) {
    auto it = pairs_.find(k);
    if (it != pairs_.end() && (it->second.words.empty() || it->second.words.back() != w)) it->second.words.push_back(w);
  }
  // Pairs containing a, b or c changed score through the denominator. Their lists may hold dead
  // or repeated keys: look each key up once, push the live ones, and rebuild the lists from them.
  for (const uint32_t s : {a, b, c}) rescore.insert(rescore.end(), sym_pairs_[s].begin(), sym_pairs_[s].end());
  std::sort(rescore.begin(), rescore.end());
  rescore.erase(std::unique(rescore.begin(), rescore.end()), rescore.end());
  for (const uint32_t s : {a, b, c}) sym_pairs_[s].clear();
  for (const Key k : rescore) {
    const auto it = pairs_.find(k);
    if (it == pairs_.end()) continue;
    push(k, it->second);
    for (const uint32_t s : {a, b, c}) {
      if ((left_of(k) == s || right_of(k) == s) && (sym_pairs_[s].empty() || sym_pairs_[s].back() != k)) {
        sym_pairs_[s].push_back(k);
      }
    }
  }
  if (heap_.size() > 4 * pairs_.size() + (1u << 20)) rebuild_heap();
}

TrainResult Trainer::run(std::vector<std::pair<std::string, uint64_t>> words) {
  TrainResult result;
  std::sort(words.begin(), words.end());

  // Characters, and the alphabet limit.
  std::vector<std::u32string> decoded(words.size());
  std::unordered_map<char32_t, uint64_t> char_count;
  for (size_t w = 0; w < words.size(); ++w) {
    const std::string& s = words[w].first;
    for (size_t i = 0; i < s.size();) decoded[w].push_back(next_code_point(s, i));
    if (decoded[w].size() > opt_.max_word_chars) continue;
    for (const char32_t cp : decoded[w]) char_count[cp] += words[w].second;
  }
  std::unordered_set<char32_t> kept;
  {
    std::vector<std::pair<uint64_t, char32_t>> by_count;
    for (const auto& [cp, n] : char_count) by_count.emplace_back(n, cp);
    std::sort(by_count.begin(), by_count.end(), [](const auto& x, const auto& y) {
      return x.first != y.first ? x.first > y.first : x.second < y.second;
    });
    if (opt_.limit_alphabet > 0 && by_count.size() > opt_.limit_alphabet) by_count.resize(opt_.limit_alphabet);
    for (const auto& [n, cp] : by_count) kept.insert(cp);
  }

  // Initial symbols: word-initial characters, then "##" continuation characters, by code point.
  std::vector<char32_t> initial, continuation;
  std::vector<size_t> used;
  for (size_t w = 0; w < words.size(); ++w) {
    const std::u32string& cps = decoded[w];
    if (cps.empty() || cps.size() > opt_.max_word_chars ||
        std::any_of(cps.begin(), cps.end(), [&](char32_t cp) { return !kept.count(cp); })) {
      ++result.words_skipped;
      continue;
    }
    used.push_back(w);
    initial.push_back(cps[0]);
    continuation.insert(continuation.end(), cps.begin() + 1, cps.end());
  }
  for (auto* list : {&initial, &continuation}) {
    std::sort(list->begin(), list->end());
    list->erase(std::unique(list->begin(), list->end()), list->end());
  }
  for (const char32_t cp : initial) {
    std::string s;
    append_utf8(s, cp);
    symbol(s);
  }
  for (const char32_t cp : continuation) {
    std::string s = "##";
    append_utf8(s, cp);
    symbol(s);
  }
  result.alphabet = sym_str_;
  result.words_used = used.size();

  // Words as symbol sequences, symbol counts, pair counts and the pair -> words index.
  segs_.reserve(used.size());
  for (const size_t w : used) {
    const auto wid = static_cast<uint32_t>(segs_.size());
    std::vector<uint32_t> seg;
    std::string s;
    for (size_t i = 0; i < decoded[w].size(); ++i) {
      s.assign(i == 0 ? "" : "##");
      append_utf8(s, decoded[w][i]);
      seg.push_back(sym_id_.at(s));
    }
    const auto wc = static_cast<int64_t>(words[w].second);
    for (size_t i = 0; i < seg.size(); ++i) {
      sym_count_[seg[i]] += wc;
      if (i + 1 < seg.size()) {
        PairInfo& p = pairs_[make_key(seg[i], seg[i + 1])];
        p.count += wc;
        if (p.words.empty() || p.words.back() != wid) p.words.push_back(wid);
      }
    }
    segs_.push_back(std::move(seg));
    word_count_.push_back(words[w].second);
  }
  word_stamp_.assign(segs_.size(), 0);
  decoded.clear();
  decoded.shrink_to_fit();
  for (const auto& [k, p] : pairs_) register_pair(k);
  for (const int64_t n : sym_count_) total_ += n;
  rebuild_heap();

  const size_t fixed = opt_.reserved + result.alphabet.size();
  const size_t target = opt_.vocab_size > fixed ? opt_.vocab_size - fixed : 0;
  auto last_report = std::chrono::steady_clock::now();
  if (progress_) progress_(0, target);
  while (result.new_tokens.size() < target && !heap_.empty()) {
    std::pop_heap(heap_.begin(), heap_.end());
    const HeapEntry top = heap_.back();
    heap_.pop_back();
    const auto it = pairs_.find(make_key(top.a, top.b));
    if (it == pairs_.end() || it->second.count != top.count) continue;  // stale: a newer entry exists
    const double now = score(top.count, top.a, top.b);
    if (now != top.score) {
      // Scores only fall while an entry waits (counts that change push a fresh entry; the "gain"
      // score falls as the corpus total shrinks), so a stored score is an upper bound: re-queue.
      if (now < top.score) {
        heap_.push_back({now, top.count, top.a, top.b});
        std::push_heap(heap_.begin(), heap_.end());
      }
      continue;
    }
    const std::string& right = sym_str_[top.b];
    if (right.compare(0, 2, "##") != 0) throw std::logic_error("right side of a pair is not a ## continuation");
    const std::string token = sym_str_[top.a] + right.substr(2);
    const bool is_new = sym_id_.find(token) == sym_id_.end();
    const uint32_t c = symbol(token);
    result.merges.push_back({sym_str_[top.a], sym_str_[top.b], token, top.score, static_cast<uint64_t>(top.count),
                             is_new});
    if (is_new) result.new_tokens.push_back(token);
    merge(top.a, top.b, c);
    if (progress_ && (result.merges.size() & 63) == 0) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last_report > std::chrono::milliseconds(200)) {
        progress_(result.new_tokens.size(), target);
        last_report = now;
      }
    }
  }
  if (progress_) progress_(result.new_tokens.size(), target);
  return result;
}

}  // namespace

TrainResult train_wordpiece(std::vector<std::pair<std::string, uint64_t>> words, const TrainOptions& options,
                            const ProgressFn& progress) {
  Trainer trainer(options, progress);
  return trainer.run(std::move(words));
}

}  // namespace fastbert::vocab
