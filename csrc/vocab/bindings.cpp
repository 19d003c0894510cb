// pybind11 entry point of fastbert._vocab: the WordPiece vocabulary trainer.
// The Python side is fastbert/tokenization/vocab_trainer.py.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <string_view>

#include "word_counter.h"
#include "wordpiece_trainer.h"

namespace py = pybind11;
using namespace fastbert::vocab;

namespace {

std::string_view view(const py::bytes& b) {
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(b.ptr(), &data, &size) != 0) throw py::error_already_set();
  return {data, static_cast<size_t>(size)};
}

void set_chars(WordCounter& counter, const std::vector<std::pair<uint32_t, std::vector<std::pair<uint32_t, int>>>>& chars) {
  for (const auto& [cp, outs] : chars) {
    std::vector<NormalizedChar> out;
    for (const auto& [c, kind] : outs) {
      if (kind < 0 || kind > kSpace) throw py::value_error("character kind must be 0 (word), 1 (isolated) or 2 (space)");
      out.push_back({static_cast<char32_t>(c), static_cast<CharKind>(kind)});
    }
    counter.set_char(cp, std::move(out));
  }
}

py::dict take_counts(WordCounter& counter) {
  WordCounts counts;
  {
    py::gil_scoped_release release;
    counts = counter.take_counts();
  }
  py::dict out;
  for (const auto& [word, n] : counts) out[py::str(word)] = py::int_(n);
  return out;
}

py::dict train(const py::dict& counts, size_t vocab_size, size_t reserved, uint64_t min_frequency,
               size_t limit_alphabet, size_t max_word_chars, const std::string& score, const py::object& progress) {
  if (score != "ratio" && score != "gain") throw py::value_error("score must be 'ratio' or 'gain', got '" + score + "'");
  std::vector<std::pair<std::string, uint64_t>> words;
  words.reserve(counts.size());
  for (const auto& [word, n] : counts) {
    const auto count = n.cast<int64_t>();
    if (count < 0) throw py::value_error("word counts must be >= 0");
    if (count > 0) words.emplace_back(word.cast<std::string>(), static_cast<uint64_t>(count));
  }
  TrainOptions options;
  options.vocab_size = vocab_size;
  options.reserved = reserved;
  options.min_frequency = std::max<uint64_t>(min_frequency, 1);
  options.limit_alphabet = limit_alphabet;
  options.max_word_chars = max_word_chars;
  options.score = score == "gain" ? Score::kGain : Score::kRatio;
  ProgressFn report;
  if (!progress.is_none()) {
    report = [&progress](size_t done, size_t total) {
      py::gil_scoped_acquire acquire;
      progress(done, total);
    };
  }
  TrainResult result;
  {
    py::gil_scoped_release release;
    result = train_wordpiece(std::move(words), options, report);
  }
  py::list merges;
  for (const auto& m : result.merges) merges.append(py::make_tuple(m.left, m.right, m.token, m.score, m.count, m.is_new));
  py::dict out;
  out["alphabet"] = result.alphabet;
  out["new_tokens"] = result.new_tokens;
  out["merges"] = merges;
  out["words_used"] = result.words_used;
  out["words_skipped"] = result.words_skipped;
  return out;
}

}  // namespace

PYBIND11_MODULE(_vocab, m) {
  m.doc() = "fastbert WordPiece vocabulary trainer: multithreaded word counting and likelihood merges.";
  m.attr("__version__") = FASTBERT_VERSION;

  py::class_<WordCounter>(m, "WordCounter",
                          "Counts the words of UTF-8 text split as the BERT basic tokenizer does, in parallel.\n"
                          "The normalization of each code point comes from Python (see `missing`, `set_chars`).")
      .def(py::init<int>(), py::arg("num_threads") = 0, "num_threads <= 0 uses every core.")
      .def("missing", [](const WordCounter& c, const py::bytes& text) {
             const std::string_view t = view(text);
             std::vector<char32_t> cps;
             {
               py::gil_scoped_release release;
               cps = c.missing(t);
             }
             return std::vector<uint32_t>(cps.begin(), cps.end());
           }, py::arg("text"), "Sorted code points of text (UTF-8 bytes) that have no normalization entry yet.")
      .def("set_chars", &set_chars, py::arg("chars"),
           "Set normalization entries: [(code point, [(normalized code point, kind), ...]), ...]; "
           "kind 0 = word character, 1 = isolated (punctuation, CJK), 2 = space. An empty list drops the character.")
      .def("add", [](WordCounter& c, const py::bytes& text) {
             const std::string_view t = view(text);
             py::gil_scoped_release release;
             c.add(t);
           }, py::arg("text"),
           "Count the words of text (UTF-8 bytes, whole lines), in parallel, without the GIL. "
           "WikiExtractor <doc ...> and </doc> lines are skipped.")
      .def("take_counts", &take_counts, "All word counts so far as {word: count}; the counter is emptied.")
      .def_property_readonly("bytes", &WordCounter::bytes, "Bytes of text added.")
      .def_property_readonly("lines", &WordCounter::lines, "Lines of text added.")
      .def_property_readonly("words", &WordCounter::words, "Words counted (with repeats).")
      .def_property_readonly("num_threads", &WordCounter::num_threads);

  m.def("train", &train, py::arg("counts"), py::arg("vocab_size"), py::arg("reserved"), py::arg("min_frequency") = 2,
        py::arg("limit_alphabet") = 0, py::arg("max_word_chars") = 100, py::arg("score") = "ratio", py::arg("progress") = py::none(),
        "Train WordPiece merges on {word: count}: start from characters (word-initial and ## continuation),\n"
        "repeatedly merge the pair with the highest score until\n"
        "reserved + alphabet + new tokens == vocab_size or no pair has min_frequency. Returns a dict:\n"
        "alphabet, new_tokens, merges [(left, right, token, score, count, is_new)], words_used, words_skipped.\n"
        "score 'ratio': count(ab) / (count(a) * count(b)); 'gain': count(ab) * (log(N * ratio) - 1), the\n"
        "first-order unigram log-likelihood gain (N = symbols in the corpus).\n"
        "progress(done, total) is called now and then.");
}
