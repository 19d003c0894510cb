"""Task data readers: real GLUE / SQuAD / CoNLL files from ../shared/data, GLUE's documented layouts
for the tasks not on hand (hand-written TSVs), and one clear error per kind of malformed input."""
import json

import pytest

from fastbert.data import conll, glue, multiple_choice, sentence_pairs, squad
from fastbert.errors import DataError


@pytest.mark.parametrize("task, split, count, labels", [
    ("cola", "train", 8551, {0: 2528, 1: 6023}),
    ("cola", "dev", 1043, {0: 322, 1: 721}),
    ("sst2", "dev", 872, {0: 428, 1: 444}),
    ("mrpc", "train", 3667, {0: 1194, 1: 2473}),
    ("mrpc", "dev", 408, {0: 129, 1: 279}),
    ("qnli", "dev", 5463, {0: 2702, 1: 2761}),
])
def test_real_glue_files(data_dir, task, split, count, labels):
    t = glue.get_task(task)
    examples = glue.read_examples(t, glue.split_path(t, data_dir / "glue", split))
    assert len(examples) == count
    assert {k: sum(e.label == k for e in examples) for k in labels} == labels
    assert all(e.text_a for e in examples)
    assert all((e.text_b is not None) == (t.text_b is not None) for e in examples)


def test_mrpc_reads_through_the_byte_order_mark(data_dir):
    t = glue.get_task("mrpc")
    first = glue.read_examples(t, glue.split_path(t, data_dir / "glue" / "MRPC", "dev"), max_samples=1)[0]
    assert first.label == 1 and first.text_a.startswith("He said the foodservice pie business")


def _write(path, rows):
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    return path


# GLUE's documented column layouts (download_glue_data.py output) for the tasks not in ../shared/data.
LAYOUTS = {
    "stsb": (["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
              "score"], ["0", "main-captions", "MSRvid", "2012test", "0001", "none", "none", "A plane is taking off.",
                         "An air plane is taking off.", "5.000"], 5.0),
    "qqp": (["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
            ["1", "2", "3", "How do I learn Python?", "What is the best way to learn Python?", "1"], 1),
    "mnli": (["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
              "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"],
             ["0", "31193", "31193n", "government", "( x )", "( y )", "(ROOT x)", "(ROOT y)",
              "Conceptually cream skimming has two basic dimensions.", "Product and geography are what make it work.",
              "neutral", "neutral"], 2),
    "rte": (["index", "sentence1", "sentence2", "label"],
            ["0", "Dana Reeve died at 44.", "Christopher Reeve had an accident.", "not_entailment"], 1),
    "wnli": (["index", "sentence1", "sentence2", "label"],
             ["0", "I stuck a pin through a carrot.", "The carrot had a hole.", "1"], 1),
}


@pytest.mark.parametrize("task", sorted(LAYOUTS))
def test_documented_layouts(tmp_path, task):
    header, row, label = LAYOUTS[task]
    t = glue.get_task(task)
    folder = tmp_path / t.folder
    folder.mkdir()
    for split in ("train",) + t.dev_splits:
        _write(folder / f"{split}.tsv", [header, row, row])
    for split in ("train",) + t.dev_splits:
        ex = glue.read_examples(t, glue.split_path(t, tmp_path, split))   # the GLUE root also works
        assert len(ex) == 2 and ex[0].label == label
        assert ex[0].text_a == row[header.index(t.text_a)] and ex[0].text_b == row[header.index(t.text_b)]


def test_qqp_skips_broken_rows_like_glue_loaders(tmp_path):
    header, row, _ = LAYOUTS["qqp"]
    path = _write(tmp_path / "train.tsv", [header, row, row[:4], row])
    assert len(glue.read_examples(glue.get_task("qqp"), path)) == 2


@pytest.mark.parametrize("rows, message", [
    ([["sentence", "label"], ["good film", "1"], ["bad film"]], r"train.tsv:3: expected at least 2"),
    ([["sentence", "label"], ["good film", "positive"]], r"label 'positive' is not one of sst2's 2 labels"),
    ([["text", "label"], ["good film", "1"]], r"header has no 'sentence' column"),
    ([["sentence", "label"]], r"holds no examples"),
])
def test_malformed_glue_tsv(tmp_path, rows, message):
    path = _write(tmp_path / "train.tsv", rows)
    with pytest.raises(DataError, match=message):
        glue.read_examples(glue.get_task("sst2"), path)


def test_glue_lookup_errors(tmp_path):
    with pytest.raises(DataError, match="unknown GLUE task 'sts'"):
        glue.get_task("sts")
    with pytest.raises(DataError, match="no GLUE rte data under"):
        glue.split_path(glue.get_task("rte"), tmp_path, "train")
    _write(tmp_path / "dev.tsv", [["index", "sentence"], ["0", "x"]])
    with pytest.raises(DataError, match="has a header row"):
        glue.read_examples(glue.get_task("cola"), tmp_path / "dev.tsv")


def test_squad_v1_dev(data_dir):
    examples, v2 = squad.read_squad(data_dir / "squad" / "dev-v1.1.json")
    assert len(examples) == 10570 and not v2
    assert len({e.title for e in examples}) == 48
    for e in examples[:500]:
        for text, start in zip(e.answers, e.answer_starts):
            assert e.context[start:start + len(text)] == text


def test_squad_v2_and_errors(tmp_path):
    doc = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": "a", "question": "Where is Paris?", "answers": [{"text": "France", "answer_start": 12}],
         "is_impossible": False},
        {"id": "b", "question": "Where is Rome?", "answers": [], "is_impossible": True}]}]}]}
    path = tmp_path / "dev-v2.0.json"
    path.write_text(json.dumps(doc))
    examples, v2 = squad.read_squad(path)
    assert v2 and [e.is_impossible for e in examples] == [False, True]
    assert squad.find_split(tmp_path, "dev") == path
    doc["data"][0]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError, match=r"qas\[0\].answers\[0\]: answer_start 99 lies outside"):
        squad.read_squad(path)
    path.write_text("{not json")
    with pytest.raises(DataError, match="is not valid JSON"):
        squad.read_squad(path)
    path.write_text(json.dumps({"data": [{"title": "t"}]}))
    with pytest.raises(DataError, match=r"data\[0\]: missing 'paragraphs'"):
        squad.read_squad(path)


def test_conll_reader_and_errors(data_dir, tmp_path):
    sents = conll.read_conll(conll.find_split(data_dir / "conll2003" / "iob2_hf_style", "dev"), max_sentences=3)
    assert [s.words for s in sents][:1] == [["CRICKET", "-", "LEICESTERSHIRE", "TAKE", "OVER", "AT", "TOP",
                                             "AFTER", "INNINGS", "VICTORY", "."]]
    assert sents[0].tags[2] == "B-ORG"
    (tmp_path / "train.txt").write_text("EU NNP B-NP B-ORG\nrejects VBZ B-VP X-Y\n")
    with pytest.raises(DataError, match=r"train.txt:2: tag 'X-Y' is not IOB"):
        conll.read_conll(tmp_path / "train.txt")
    with pytest.raises(DataError, match="no dev file"):
        conll.find_split(tmp_path, "dev")


def test_multiple_choice_jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"context": "She opened the fridge.", "question": "Then she",
                                "choices": ["took out milk.", "flew away."], "label": 0}) + "\n\n" +
                    json.dumps({"question": "2 + 2 =", "choices": ["4", "5"], "label": 0}) + "\n")
    ex = multiple_choice.read_jsonl(path)
    assert ex[0].first == "She opened the fridge." and ex[0].seconds == ["Then she took out milk.", "Then she flew away."]
    assert ex[1].first == "2 + 2 =" and ex[1].seconds == ["4", "5"]
    bad = {
        '{"choices": ["a", "b"], "label": 0}': "needs a 'context' or a 'question'",
        '{"context": "c", "choices": ["a"], "label": 0}': "at least two strings",
        '{"context": "c", "choices": ["a", "b"], "label": 2}': r"label 2 must be an integer in \[0, 2\)",
        '{"context": "c", "choices": ["a", "b"]}': "missing 'label'",
        '["a"]': "expected a JSON object",
        '{"context": "c", "choices": ["a", "b"], "label": 0': "not valid JSON",
    }
    for line, message in bad.items():
        path.write_text(line + "\n")
        with pytest.raises(DataError, match=message):
            multiple_choice.read_jsonl(path)
    path.write_text('{"context": "c", "choices": ["a", "b"], "label": 0}\n{"context": "c", "choices": ["a", "b", "c"], '
                    '"label": 0}\n')
    with pytest.raises(DataError, match="3 choices but earlier lines have 2"):
        multiple_choice.read_jsonl(path)


def test_sentence_pair_layouts(data_dir, tmp_path):
    pairs, layout, kind = sentence_pairs.read_pairs(data_dir / "glue" / "MRPC" / "dev.tsv")
    assert (layout, kind, len(pairs)) == ("mrpc", "label", 408) and pairs[0].target == "1"
    sts = _write(tmp_path / "sts.tsv", [LAYOUTS["stsb"][0], LAYOUTS["stsb"][1]])
    pairs, layout, kind = sentence_pairs.read_pairs(sts)
    assert (layout, kind, pairs[0].target) == ("stsb", "score", 5.0)
    nli_header = LAYOUTS["mnli"][0]
    row = LAYOUTS["mnli"][1]
    nli = _write(tmp_path / "nli.tsv", [nli_header, row, row[:-1] + ["-"]])
    pairs, layout, _ = sentence_pairs.read_pairs(nli)
    assert layout == "nli" and len(pairs) == 1   # "-" (no gold consensus) is skipped
    with pytest.raises(DataError, match="cannot tell the sentence-pair layout"):
        sentence_pairs.read_pairs(_write(tmp_path / "x.tsv", [["a", "b"], ["x", "y"]]))
