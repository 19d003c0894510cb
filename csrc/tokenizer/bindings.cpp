// pybind11 entry point of fastbert._wordpiece: build information and the WordPiece tokenizer core.
// Python strings are read in place (PEP 393 storage: 1, 2 or 4 bytes per code point) with the GIL
// held; tokenization and output filling run with the GIL released on the thread pool.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstring>
#include <string>

#include "normalizer.h"
#include "thread_pool.h"
#include "tokenizer.h"

namespace py = pybind11;
using namespace fastbert;

void register_gpu_emulation(py::module_& m);  // gpu_emulation.cpp

namespace {

py::dict build_info() {
  py::dict info;
  info["version"] = FASTBERT_VERSION;
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#else
  info["compiler"] = "unknown";
#endif
  info["cplusplus"] = static_cast<long>(__cplusplus);
  info["unicode_version"] = unicode_version();
  info["hardware_threads"] = ThreadPool::hardware_threads();
  info["cuda"] = false;  // the CUDA tokenizer is the separate module fastbert._wordpiece_cuda
  return info;
}

TextRef text_ref(PyObject* obj, const char* what, Py_ssize_t index) {
  if (!PyUnicode_Check(obj)) {
    std::string where = index >= 0 ? std::string(what) + "[" + std::to_string(index) + "]" : std::string(what);
    throw py::type_error(where + " must be a str, got " + Py_TYPE(obj)->tp_name);
  }
#if PY_VERSION_HEX < 0x030C0000
  if (PyUnicode_READY(obj) < 0) throw py::error_already_set();
#endif
  TextRef t;
  t.kind = static_cast<int>(PyUnicode_KIND(obj));
  t.data = PyUnicode_DATA(obj);
  t.length = PyUnicode_GET_LENGTH(obj);
  if (t.length > INT32_MAX) throw py::value_error("texts longer than 2**31 - 1 characters are not supported; split them");
  return t;
}

// A tuple of the sequence's items: keeps every string alive while the GIL is released.
py::tuple as_tuple(const py::handle& seq, const char* what) {
  if (PyUnicode_Check(seq.ptr()))
    throw py::type_error(std::string(what) + " must be a list of str, not a single str");
  PyObject* t = PySequence_Tuple(seq.ptr());
  if (!t) throw py::type_error(std::string(what) + " must be a list of str");
  return py::reinterpret_steal<py::tuple>(t);
}

[[noreturn]] void raise_surrogate(const EncodeError& e, const char* what) {
  char cp[16];
  std::snprintf(cp, sizeof(cp), "U+%04X", e.cp);
  std::string where = e.text >= 0 ? std::string(what) + "[" + std::to_string(e.text) + "]" : std::string(what);
  throw py::value_error(where + " contains a lone surrogate " + cp + " at character " + std::to_string(e.position) +
                        ": it has no UTF-8 form, so it cannot be tokenized (HF raises too). Repair the text, e.g. "
                        "s.encode('utf-16', 'surrogatepass').decode('utf-16', 'replace')");
}

int resolve_threads(int num_threads) {
  if (num_threads < 0) throw py::value_error("num_threads must be >= 1 (or None for all cores)");
  return num_threads == 0 ? ThreadPool::hardware_threads() : num_threads;
}

PostOptions::Strategy parse_strategy(const std::string& s) {
  if (s == "none") return PostOptions::kNone;
  if (s == "longest_first") return PostOptions::kLongestFirst;
  if (s == "only_first") return PostOptions::kOnlyFirst;
  if (s == "only_second") return PostOptions::kOnlySecond;
  throw py::value_error("unknown truncation strategy '" + s + "'");
}

template <typename T>
py::array_t<T> copy_array(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::vector<std::string>& vocab, bool lowercase, bool strip_accents,
                                          bool tokenize_chinese_chars, int max_input_chars_per_word, int32_t unk_id,
                                          const std::vector<std::pair<std::u32string, int32_t>>& specials) {
  if (vocab.empty()) throw py::value_error("the vocabulary is empty");
  if (max_input_chars_per_word < 1) throw py::value_error("max_input_chars_per_word must be >= 1");
  if (unk_id < 0 || unk_id >= static_cast<int32_t>(vocab.size()))
    throw py::value_error("unk_id " + std::to_string(unk_id) + " is not in the vocabulary");
  TokenizerConfig config;
  config.norm.lowercase = lowercase;
  config.norm.strip_accents = strip_accents;
  config.norm.chinese = tokenize_chinese_chars;
  config.max_input_chars_per_word = max_input_chars_per_word;
  config.unk_id = unk_id;
  config.specials = specials;
  py::gil_scoped_release release;
  return std::make_unique<Tokenizer>(vocab, config);
}

py::tuple encode_one(const Tokenizer& tok, const py::handle& text) {
  const TextRef ref = text_ref(text.ptr(), "text", -1);
  TokenSink sink;
  try {
    py::gil_scoped_release release;
    tok.encode(ref, sink);
  } catch (const EncodeError& e) {
    raise_surrogate(e, "text");
  }
  const py::ssize_t n = sink.size();
  py::array_t<int32_t> ids(n);
  py::array_t<int32_t> offsets({n, static_cast<py::ssize_t>(2)});
  int32_t *p_ids = ids.mutable_data(), *off = offsets.mutable_data();
  for (py::ssize_t k = 0; k < n; ++k) {
    p_ids[k] = sink.tokens[k].id;
    off[2 * k] = sink.tokens[k].start;
    off[2 * k + 1] = sink.tokens[k].end;
  }
  return py::make_tuple(ids, offsets);
}

py::list pre_tokenize(const Tokenizer& tok, const py::handle& text) {
  const TextRef ref = text_ref(text.ptr(), "text", -1);
  std::vector<PreToken> words;
  try {
    py::gil_scoped_release release;
    words = tok.pre_tokenize(ref);
  } catch (const EncodeError& e) {
    raise_surrogate(e, "text");
  }
  py::list out;
  for (const PreToken& w : words)
    out.append(py::make_tuple(py::str(w.word), py::make_tuple(w.start, w.end)));
  return out;
}

// Tokenizes texts (and pairs) on the pool; returns the tokens and each row's segment indices.
BatchTokens tokenize_rows(const Tokenizer& tok, const py::tuple& texts, const py::object& pairs, int threads,
                          std::vector<int64_t>& first, std::vector<int64_t>& second) {
  const Py_ssize_t n = py::len(texts);
  std::vector<TextRef> segments;
  segments.reserve(pairs.is_none() ? n : 2 * n);
  for (Py_ssize_t i = 0; i < n; ++i) segments.push_back(text_ref(texts[i].ptr(), "texts", i));
  first.resize(n);
  second.assign(n, -1);
  for (Py_ssize_t i = 0; i < n; ++i) first[i] = i;
  if (!pairs.is_none()) {
    const py::tuple p = pairs.cast<py::tuple>();
    for (Py_ssize_t i = 0; i < n; ++i) {
      segments.push_back(text_ref(p[i].ptr(), "text_pairs", i));
      second[i] = n + i;
    }
  }
  try {
    py::gil_scoped_release release;
    return tok.encode_batch(segments, threads);
  } catch (EncodeError& e) {
    const bool in_pairs = e.text >= n;
    if (in_pairs) e.text -= n;
    raise_surrogate(e, in_pairs ? "text_pairs" : "texts");
  }
}

py::dict encode_batch(const Tokenizer& tok, const py::handle& texts_in, const py::handle& pairs_in,
                      bool add_special_tokens, int64_t max_length, const std::string& truncation,
                      const std::string& padding, int64_t pad_to_multiple_of, bool return_offsets, int num_threads,
                      int32_t cls_id, int32_t sep_id, int32_t pad_id) {
  const int threads = resolve_threads(num_threads);
  const py::tuple texts = as_tuple(texts_in, "texts");
  py::object pairs = py::none();
  if (!pairs_in.is_none()) {
    pairs = as_tuple(pairs_in, "text_pairs");
    if (py::len(pairs) != py::len(texts))
      throw py::value_error("texts and text_pairs differ in length (" + std::to_string(py::len(texts)) +
                            " != " + std::to_string(py::len(pairs)) + ")");
  }
  if (padding != "none" && padding != "longest" && padding != "max_length")
    throw py::value_error("unknown padding '" + padding + "'");
  PostOptions post;
  post.add_special_tokens = add_special_tokens;
  post.max_length = max_length;
  post.strategy = parse_strategy(truncation);
  post.cls_id = cls_id;
  post.sep_id = sep_id;
  post.pad_id = pad_id;
  if (add_special_tokens && (cls_id < 0 || sep_id < 0)) throw py::value_error("cls_id and sep_id are needed");

  std::vector<int64_t> first, second;
  const BatchTokens tokens = tokenize_rows(tok, texts, pairs, threads, first, second);
  RowLayout layout;
  {
    py::gil_scoped_release release;
    layout = tok.layout(tokens, first, second, post);
  }
  const py::ssize_t rows = static_cast<py::ssize_t>(first.size());
  py::dict out;
  if (padding == "none") {
    py::ssize_t total = 0;
    for (int64_t t : layout.total) total += t;
    py::array_t<int64_t> splits(rows + 1), ids(total), types(total);
    py::array_t<int64_t> offsets = return_offsets ? py::array_t<int64_t>({total, static_cast<py::ssize_t>(2)})
                                                  : py::array_t<int64_t>(0);
    int64_t *p_splits = splits.mutable_data(), *p_ids = ids.mutable_data(), *p_types = types.mutable_data();
    int64_t* p_off = return_offsets ? offsets.mutable_data() : nullptr;
    {
      py::gil_scoped_release release;
      tok.fill_flat(tokens, first, second, layout, post, p_splits, p_ids, p_types, p_off, threads);
    }
    out["input_ids"] = ids;
    out["token_type_ids"] = types;
    if (return_offsets) out["offsets"] = offsets;
    out["row_splits"] = splits;
    return out;
  }
  int64_t width = layout.longest;
  if (padding == "max_length") {
    if (max_length < 0) throw py::value_error("padding='max_length' needs max_length");
    for (py::ssize_t r = 0; r < rows; ++r)
      if (layout.total[r] > max_length)
        throw py::value_error("row " + std::to_string(r) + " has " + std::to_string(layout.total[r]) +
                              " tokens, more than max_length=" + std::to_string(max_length) +
                              " (truncation is off), so the rows cannot form one array; pass truncation=True "
                              "or padding='longest'");
    width = max_length;
  }
  if (pad_to_multiple_of > 0) width = (width + pad_to_multiple_of - 1) / pad_to_multiple_of * pad_to_multiple_of;
  py::array_t<int64_t> ids({rows, static_cast<py::ssize_t>(width)});
  py::array_t<int64_t> types({rows, static_cast<py::ssize_t>(width)});
  py::array_t<int64_t> mask({rows, static_cast<py::ssize_t>(width)});
  py::array_t<int64_t> offsets = return_offsets
                                     ? py::array_t<int64_t>({rows, static_cast<py::ssize_t>(width), py::ssize_t(2)})
                                     : py::array_t<int64_t>(0);
  int64_t *p_ids = ids.mutable_data(), *p_types = types.mutable_data(), *p_mask = mask.mutable_data();
  int64_t* p_off = return_offsets ? offsets.mutable_data() : nullptr;
  {
    py::gil_scoped_release release;
    tok.fill_padded(tokens, first, second, layout, post, width, p_ids, p_types, p_mask, p_off, threads);
  }
  out["input_ids"] = ids;
  out["token_type_ids"] = types;
  out["attention_mask"] = mask;
  if (return_offsets) out["offsets"] = offsets;
  return out;
}

// Token ids of every text back to back (no special tokens) and where each text starts.
py::tuple encode_flat(const Tokenizer& tok, const py::handle& texts_in, int num_threads) {
  const int threads = resolve_threads(num_threads);
  const py::tuple texts = as_tuple(texts_in, "texts");
  std::vector<int64_t> first, second;
  const BatchTokens tokens = tokenize_rows(tok, texts, py::none(), threads, first, second);
  const py::ssize_t rows = static_cast<py::ssize_t>(first.size());
  py::array_t<int64_t> splits(rows + 1);
  int64_t* p_splits = splits.mutable_data();
  p_splits[0] = 0;
  for (py::ssize_t r = 0; r < rows; ++r) p_splits[r + 1] = p_splits[r] + tokens.seg_count[r];
  py::array_t<int32_t> ids(static_cast<py::ssize_t>(p_splits[rows]));
  int32_t* p_ids = ids.mutable_data();
  {
    py::gil_scoped_release release;
    const int64_t per_task = 1024;
    ThreadPool::instance().run((rows + per_task - 1) / per_task, threads, [&](int64_t task) {
      for (int64_t r = task * per_task; r < std::min<int64_t>(rows, (task + 1) * per_task); ++r) {
        const Token* t = tokens.sink(r).tokens.data() + tokens.seg_begin[r];
        int32_t* dst = p_ids + p_splits[r];
        for (int64_t k = 0; k < tokens.seg_count[r]; ++k) dst[k] = t[k].id;
      }
    });
  }
  return py::make_tuple(ids, splits);
}

// --- for the batched GPU path (fastbert/tokenization/_cuda.py) ---------------------------------

// Where each text's code units go in one buffer: (seg_byte, seg_kind, seg_char, total_bytes).
// Segments are the texts, then the pairs; each starts 4-byte aligned.
// Texts then pairs as TextRefs (type-checked); `keep` holds the tuples that keep them alive.
std::vector<TextRef> segment_refs(const py::handle& texts_in, const py::handle& pairs_in, std::vector<py::tuple>& keep) {
  keep.push_back(as_tuple(texts_in, "texts"));
  const Py_ssize_t n = static_cast<Py_ssize_t>(py::len(keep[0]));
  std::vector<TextRef> refs;
  for (Py_ssize_t i = 0; i < n; ++i) refs.push_back(text_ref(keep[0][i].ptr(), "texts", i));
  if (!pairs_in.is_none()) {
    keep.push_back(as_tuple(pairs_in, "text_pairs"));
    if (static_cast<Py_ssize_t>(py::len(keep[1])) != n)
      throw py::value_error("texts and text_pairs differ in length (" + std::to_string(n) + " != " +
                            std::to_string(py::len(keep[1])) + ")");
    for (Py_ssize_t i = 0; i < n; ++i) refs.push_back(text_ref(keep[1][i].ptr(), "text_pairs", i));
  }
  return refs;
}

py::tuple text_layout(const py::handle& texts_in, const py::handle& pairs_in) {
  std::vector<py::tuple> keep;
  const std::vector<TextRef> refs = segment_refs(texts_in, pairs_in, keep);
  const py::ssize_t n = static_cast<py::ssize_t>(refs.size());
  py::array_t<int64_t> seg_byte(n), seg_char(n + 1);
  py::array_t<int32_t> seg_kind(n);
  int64_t bytes = 0, chars = 0;
  for (py::ssize_t s = 0; s < n; ++s) {
    seg_byte.mutable_data()[s] = bytes;
    seg_kind.mutable_data()[s] = refs[s].kind;
    seg_char.mutable_data()[s] = chars;
    bytes += (refs[s].length * refs[s].kind + 3) & ~int64_t(3);
    chars += refs[s].length;
  }
  seg_char.mutable_data()[n] = chars;
  return py::make_tuple(seg_byte, seg_kind, seg_char, bytes);
}

// Copies every text's code units into `out` (uint8, as laid out by text_layout) on the thread pool.
void pack_texts(const py::handle& texts_in, const py::handle& pairs_in, py::array_t<uint8_t> out,
                py::array_t<int64_t> seg_byte) {
  std::vector<py::tuple> keep;
  const std::vector<TextRef> refs = segment_refs(texts_in, pairs_in, keep);
  if (seg_byte.size() != static_cast<py::ssize_t>(refs.size())) throw py::value_error("seg_byte does not match the texts");
  uint8_t* dst = out.mutable_data();
  const int64_t* at = seg_byte.data();
  const int64_t capacity = out.size();
  for (size_t s = 0; s < refs.size(); ++s)
    if (at[s] + refs[s].length * refs[s].kind > capacity) throw py::value_error("pack_texts: buffer too small");
  py::gil_scoped_release release;
  const int64_t per_task = 1024;
  const int64_t tasks = (static_cast<int64_t>(refs.size()) + per_task - 1) / per_task;
  ThreadPool::instance().run(tasks, ThreadPool::hardware_threads(), [&](int64_t t) {
    for (int64_t s = t * per_task; s < std::min<int64_t>((t + 1) * per_task, static_cast<int64_t>(refs.size())); ++s)
      std::memcpy(dst + at[s], refs[s].data, refs[s].length * refs[s].kind);
  });
}

// HF truncation on token counts per segment: (len_a, len_b, total) per row.
py::tuple row_layout_py(py::array_t<int64_t> seg_count, int64_t rows, bool has_pairs, bool add_special_tokens,
                        int64_t max_length, const std::string& truncation) {
  if (seg_count.size() != (has_pairs ? 2 * rows : rows)) throw py::value_error("seg_count does not match the rows");
  PostOptions post;
  post.add_special_tokens = add_special_tokens;
  post.max_length = max_length;
  post.strategy = parse_strategy(truncation);
  std::vector<int64_t> first(rows), second(rows, -1);
  for (int64_t r = 0; r < rows; ++r) {
    first[r] = r;
    if (has_pairs) second[r] = rows + r;
  }
  const RowLayout layout = row_layout(seg_count.data(), first, second, post);
  return py::make_tuple(copy_array(layout.len_a), copy_array(layout.len_b), copy_array(layout.total));
}

// Every table the tokenizer runs on, as NumPy copies: the CUDA path uploads these.
py::dict tables(const Tokenizer& tok) {
  const NormTable& n = tok.norm();
  const WordPieceTrie& t = tok.trie();
  py::dict d;
  d["norm_stage1"] = copy_array(n.stage1);
  d["norm_stage2"] = copy_array(n.stage2);
  d["norm_pool"] = copy_array(n.pool);
  d["dec_cp"] = copy_array(n.dec_cp);
  d["dec_start"] = copy_array(n.dec_start);
  d["dec_len"] = copy_array(n.dec_len);
  d["dec_pool"] = copy_array(n.dec_pool);
  d["ccc_lo"] = copy_array(n.ccc_lo);
  d["ccc_hi"] = copy_array(n.ccc_hi);
  d["ccc_val"] = copy_array(n.ccc_val);
  static_assert(sizeof(TrieNode) == 16, "packed trie nodes");
  py::array_t<int32_t> nodes({static_cast<py::ssize_t>(t.nodes.size()), py::ssize_t(4)});
  std::memcpy(nodes.mutable_data(), t.nodes.data(), t.nodes.size() * sizeof(TrieNode));
  d["trie_nodes"] = nodes;
  d["trie_pops"] = copy_array(t.pops);
  d["root"] = t.root;
  d["suffix_root"] = t.suffix_root;
  return d;
}

}  // namespace

PYBIND11_MODULE(_wordpiece, m) {
  m.doc() = "fastbert native extension: build information and the C++ WordPiece tokenizer core "
            "(use fastbert.tokenization.WordPieceTokenizer, the Python API over it).";
  m.attr("__version__") = FASTBERT_VERSION;
  m.def("build_info", &build_info, "Return a dict describing how this extension was built.");
  m.def("hardware_threads", &ThreadPool::hardware_threads, "Number of hardware threads (the default thread count).");
  m.def("text_layout", &text_layout, py::arg("texts"), py::arg("pairs"),
        "GPU path: (seg_byte, seg_kind, seg_char, total_bytes) of texts then pairs in one buffer.");
  m.def("pack_texts", &pack_texts, py::arg("texts"), py::arg("pairs"), py::arg("out"), py::arg("seg_byte"),
        "GPU path: copy the texts' code units into `out` as laid out by text_layout.");
  m.def("row_layout", &row_layout_py, py::arg("seg_count"), py::arg("rows"), py::arg("has_pairs"),
        py::arg("add_special_tokens"), py::arg("max_length"), py::arg("truncation"),
        "GPU path: HF truncation on token counts: (len_a, len_b, total) per row.");
  register_gpu_emulation(m);

  py::class_<Tokenizer>(m, "WordPieceCore",
                        "BERT normalization + pre-tokenization + WordPiece (LinMaxMatch) over a vocabulary, "
                        "with HF BertTokenizerFast's results. Thread-safe; batch methods release the GIL.")
      .def(py::init(&make_tokenizer), py::arg("vocab"), py::arg("lowercase"), py::arg("strip_accents"),
           py::arg("tokenize_chinese_chars"), py::arg("max_input_chars_per_word"), py::arg("unk_id"),
           py::arg("specials"),
           "vocab: tokens by id. specials: (text, id) pairs matched as whole strings in the raw text.")
      .def("encode", &encode_one, py::arg("text"),
           "Tokens of one text without special tokens: (ids int32 (n,), offsets int32 (n, 2)), offsets in "
           "code points of the original text.")
      .def("pre_tokenize", &pre_tokenize, py::arg("text"),
           "Normalized words of one text with their (start, end) code point spans: HF's BertNormalizer + "
           "BertPreTokenizer splits (no special-token matching, no word length limit).")
      .def("encode_batch", &encode_batch, py::arg("texts"), py::arg("pairs"), py::arg("add_special_tokens"),
           py::arg("max_length"), py::arg("truncation"), py::arg("padding"), py::arg("pad_to_multiple_of"),
           py::arg("return_offsets"), py::arg("num_threads"), py::arg("cls_id"), py::arg("sep_id"),
           py::arg("pad_id"),
           "Encode rows [CLS] a [SEP] (b [SEP]) with HF truncation (max_length -1: none; truncation 'none', "
           "'longest_first', 'only_first', 'only_second') and padding ('none', 'longest', 'max_length'). "
           "Returns int64 arrays: padded (rows, width) input_ids, token_type_ids, attention_mask and "
           "(rows, width, 2) offsets; or, with padding 'none', flat arrays plus row_splits (rows + 1). "
           "num_threads 0: all cores.")
      .def("encode_flat", &encode_flat, py::arg("texts"), py::arg("num_threads"),
           "Token ids (int32) of every text back to back without special tokens, and row_splits "
           "(int64, len(texts) + 1) where each text starts.")
      .def("tables", &tables, "The normalization table, NFD data and LinMaxMatch trie as NumPy arrays.")
      .def_property_readonly("num_trie_nodes", [](const Tokenizer& t) { return t.trie().num_nodes; })
      .def_property_readonly("max_input_chars_per_word",
                             [](const Tokenizer& t) { return t.config().max_input_chars_per_word; });
}
