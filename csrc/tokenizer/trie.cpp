// LinMaxMatch trie construction (trie.h): breadth-first double-array placement, then failure links
// and failure pops in the same breadth-first order (a node's links only use shallower nodes).
#include "trie.h"

#include <algorithm>
#include <deque>
#include <stdexcept>
#include <unordered_map>
#include <utility>

namespace fastbert {
namespace {

constexpr int32_t kFree = -1;
constexpr int32_t kRootCheck = -2;       // the root is nobody's child
constexpr uint8_t kSuffixEdge = 0xFF;    // root -> suffix root; never a UTF-8 byte

struct Placed {
  int32_t node, parent;
  uint8_t byte;
};

}  // namespace

WordPieceTrie::WordPieceTrie(const std::vector<std::string>& tokens, const std::string& prefix) {
  // Keys: word-initial tokens as they are, "##x" as 0xFF + "x". A repeated token keeps its last id.
  if (tokens.size() > kPopIdMask) throw std::invalid_argument("vocabularies are limited to 2**24 tokens");
  std::unordered_map<std::string, int32_t> ids;
  ids.reserve(tokens.size() * 2);
  std::vector<uint32_t> piece_len(tokens.size(), 0);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string& tok = tokens[i];
    const bool suffix = !prefix.empty() && tok.size() > prefix.size() && tok.compare(0, prefix.size(), prefix) == 0;
    if (tok.empty() || tok == prefix) continue;
    std::string key = suffix ? std::string(1, static_cast<char>(kSuffixEdge)) + tok.substr(prefix.size()) : tok;
    piece_len[i] = static_cast<uint32_t>(suffix ? tok.size() - prefix.size() : tok.size());
    if (piece_len[i] > 255)
      throw std::invalid_argument("vocabulary token longer than 255 bytes (without '##'): " + tok.substr(0, 40) + "...");
    ids[std::move(key)] = static_cast<int32_t>(i);
  }
  std::vector<std::pair<std::string, int32_t>> keys(ids.begin(), ids.end());
  std::sort(keys.begin(), keys.end());  // std::string compares bytes as unsigned char

  // Breadth-first double-array placement. Free slots form a doubly linked list, so the search for
  // a base visits free slots only (without it, placement is quadratic in the vocabulary size).
  struct Slot {
    int32_t base, check;
  };
  std::vector<Slot> slots(1 << 12, Slot{0, kFree});
  std::vector<int32_t> terminal(slots.size(), -1), next_free(slots.size(), -1), prev_free(slots.size(), -1);
  int32_t head = -1, tail = -1;
  auto link = [&](size_t from, size_t to) {
    for (size_t s = from; s < to; ++s) {
      prev_free[s] = tail;
      next_free[s] = -1;
      if (tail >= 0) next_free[tail] = static_cast<int32_t>(s);
      else head = static_cast<int32_t>(s);
      tail = static_cast<int32_t>(s);
    }
  };
  auto occupy = [&](int32_t s, int32_t parent) {
    slots[s].check = parent;
    if (prev_free[s] >= 0) next_free[prev_free[s]] = next_free[s];
    else head = next_free[s];
    if (next_free[s] >= 0) prev_free[next_free[s]] = prev_free[s];
    else tail = prev_free[s];
  };
  auto grow = [&](size_t need) {
    if (need <= slots.size()) return;
    const size_t old = slots.size();
    size_t n = old;
    while (n < need) n *= 2;
    slots.resize(n, Slot{0, kFree});
    terminal.resize(n, -1);
    next_free.resize(n, -1);
    prev_free.resize(n, -1);
    link(old, n);
  };
  root = 0;
  slots[0].check = kRootCheck;
  link(1, slots.size());
  std::vector<Placed> order;  // every node but the root, parents before children
  struct Pending {
    int32_t node;
    size_t lo, hi, depth;
  };
  std::deque<Pending> queue{{root, 0, keys.size(), 0}};
  std::vector<std::pair<uint8_t, std::pair<size_t, size_t>>> children;
  while (!queue.empty()) {
    const Pending p = queue.front();
    queue.pop_front();
    size_t i = p.lo;
    if (i < p.hi && keys[i].first.size() == p.depth) terminal[p.node] = keys[i++].second;
    children.clear();
    while (i < p.hi) {
      const uint8_t c = static_cast<uint8_t>(keys[i].first[p.depth]);
      size_t j = i + 1;
      while (j < p.hi && static_cast<uint8_t>(keys[j].first[p.depth]) == c) ++j;
      children.push_back({c, {i, j}});
      i = j;
    }
    if (p.node == root && (children.empty() || children.back().first != kSuffixEdge))
      children.push_back({kSuffixEdge, {p.hi, p.hi}});  // the suffix root exists even without "##" tokens
    if (children.empty()) continue;
    // The first free slot s (s > c_min) such that base = s - c_min has every child slot free.
    const int32_t c_min = children.front().first;
    int32_t s = head;
    while (s >= 0 && s <= c_min) s = next_free[s];
    int32_t base;
    for (;;) {
      if (s < 0) {  // out of free slots: add some and continue with the first new one
        const size_t old = slots.size();
        grow(old * 2);
        s = static_cast<int32_t>(std::max<size_t>(old, c_min + 1));
      }
      grow(static_cast<size_t>(s) + 257);
      base = s - c_min;
      bool ok = true;
      for (const auto& ch : children)
        if (slots[base + ch.first].check != kFree) { ok = false; break; }
      if (ok) break;
      s = next_free[s];
    }
    slots[p.node].base = base;
    for (const auto& ch : children) {
      const int32_t node = base + ch.first;
      occupy(node, p.node);
      order.push_back({node, p.node, ch.first});
      queue.push_back({node, ch.second.first, ch.second.second, p.depth + 1});
      if (p.node == root && ch.first == kSuffixEdge) suffix_root = node;
    }
  }
  grow(slots.size() + 256);  // base + byte of any node stays in bounds
  num_nodes = static_cast<int64_t>(order.size()) + 1;

  // Failure links and pops (Song et al. 2021, Algorithm 2).
  auto child = [&](int32_t node, uint8_t c) -> int32_t {
    const int32_t t = slots[node].base + c;
    return slots[t].check == node ? t : -1;
  };
  nodes.resize(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) nodes[i] = TrieNode{slots[i].base, slots[i].check, -1, 0};
  auto pack = [](size_t offset, size_t count) {
    if (offset >= (1u << 24) || count > 255)
      throw std::invalid_argument("vocabulary too large for the WordPiece trie (failure pops overflow)");
    return static_cast<uint32_t>(offset << 8 | count);
  };
  std::vector<uint32_t> acc;
  for (const Placed& v : order) {
    if (v.node == suffix_root) continue;
    if (terminal[v.node] >= 0) {  // a token: emit it, go on with "##" pieces
      nodes[v.node].fail = suffix_root;
      nodes[v.node].pops = pack(pops.size(), 1);
      const int32_t id = terminal[v.node];
      pops.push_back(static_cast<uint32_t>(id) | piece_len[id] << 24);
      continue;
    }
    const TrieNode& up = nodes[v.parent];
    int32_t z = up.fail;
    acc.assign(pops.begin() + (up.pops >> 8), pops.begin() + (up.pops >> 8) + (up.pops & 0xFF));
    while (z >= 0 && child(z, v.byte) < 0) {
      const TrieNode& fz = nodes[z];
      acc.insert(acc.end(), pops.begin() + (fz.pops >> 8), pops.begin() + (fz.pops >> 8) + (fz.pops & 0xFF));
      z = fz.fail;
    }
    if (z < 0) continue;  // no way on: a word stuck here is [UNK]
    nodes[v.node].fail = child(z, v.byte);
    nodes[v.node].pops = pack(pops.size(), acc.size());
    pops.insert(pops.end(), acc.begin(), acc.end());
  }
  if (pops.empty()) pops.push_back(0);  // keep data() valid for device copies
}

}  // namespace fastbert
