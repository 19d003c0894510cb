// WordPiece vocabulary training by likelihood: start from characters, then repeatedly merge the
// adjacent pair with the highest score count(ab) / (count(a) * count(b)).
//
// Symbols are strings: a word-initial piece ("un") or a continuation ("##aff"). Merging (a, b)
// gives a + b without b's "##"; when that string already exists (reached by another split),
// the existing symbol is reused and the vocabulary does not grow.
//
// Each merge touches only the words that contain the pair (an index pair -> words), and
// re-scores only the pairs whose count changed plus every pair containing a, b or the new
// symbol (their denominators changed). The best pair comes from a max-heap with lazy
// invalidation: an entry is used only if its score equals the pair's current score; a stored
// score never underestimates the current one, so the first valid entry is the true maximum.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace fastbert::vocab {

// kRatio: count(ab) / (count(a) * count(b)), the score as usually described for WordPiece.
// kGain: count(ab) * (log(N * count(ab) / (count(a) * count(b))) - 1), the first-order gain in
// unigram log-likelihood of the corpus (N symbols) when ab becomes one symbol: the ratio weighted
// by how often the pair occurs, so that frequent pieces come before rare words.
enum class Score { kRatio, kGain };

struct TrainOptions {
  Score score = Score::kRatio;
  size_t vocab_size = 30522;    // the size of the whole vocabulary
  size_t reserved = 999;        // entries taken by special tokens and [unusedN] slots
  uint64_t min_frequency = 2;   // pairs seen fewer times are never merged
  size_t limit_alphabet = 0;    // keep only the most frequent characters (0 = all)
  size_t max_word_chars = 100;  // longer words are [UNK] for the tokenizer: not used for training
};

struct MergeRecord {
  std::string left, right, token;
  double score;
  uint64_t count;
  bool is_new;  // false when token already existed
};

struct TrainResult {
  std::vector<std::string> alphabet;  // initial characters, then "##" characters, by code point
  std::vector<MergeRecord> merges;    // in the order they were made
  std::vector<std::string> new_tokens;  // tokens that merges added, in order
  uint64_t words_used = 0, words_skipped = 0;  // distinct words (too long, or with dropped characters)
};

// progress(done, total) is called now and then with the number of new tokens so far.
using ProgressFn = std::function<void(size_t, size_t)>;

// words: distinct words with their counts, in any order (they are sorted for determinism).
TrainResult train_wordpiece(std::vector<std::pair<std::string, uint64_t>> words, const TrainOptions& options,
                            const ProgressFn& progress);

}  // namespace fastbert::vocab
