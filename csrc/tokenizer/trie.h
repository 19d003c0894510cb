// The WordPiece vocabulary as a LinMaxMatch trie (wordpiece_core.h): a byte-level double array
// with failure links and failure pops, built once per tokenizer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "wordpiece_core.h"

namespace fastbert {

class WordPieceTrie {
 public:
  // tokens[i] is the token with id i; a repeated token keeps its last id (as HF). Tokens starting
  // with `prefix` continue a word. Tokens that can never match (empty, the bare prefix) are skipped.
  WordPieceTrie(const std::vector<std::string>& tokens, const std::string& prefix = "##");

  TrieView view() const { return {nodes.data(), pops.data(), root, suffix_root}; }

  std::vector<TrieNode> nodes;  // double array, indexed by slot
  std::vector<uint32_t> pops;   // failure pops (wordpiece_core.h)
  int32_t root = 0;
  int32_t suffix_root = -1;
  int64_t num_nodes = 0;
};

}  // namespace fastbert
