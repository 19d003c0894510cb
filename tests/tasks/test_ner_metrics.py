"""Entity-level NER scoring on hand-built cases, and IOB1/IOB2 handling checked on real CoNLL-2003."""
import pytest

from fastbert.data.conll import find_split, read_conll
from fastbert.tasks.ner_metrics import detect_scheme, entity_scores, get_entities, iob1_to_iob2


@pytest.mark.parametrize("tags, entities", [
    ("B-PER I-PER O B-LOC".split(), [("PER", 0, 1), ("LOC", 3, 3)]),                 # IOB2
    ("I-PER I-PER B-PER O I-LOC".split(), [("PER", 0, 1), ("PER", 2, 2), ("LOC", 4, 4)]),  # IOB1
    ("I-ORG I-LOC".split(), [("ORG", 0, 0), ("LOC", 1, 1)]),                          # type change splits
    ("O I-MISC I-MISC".split(), [("MISC", 1, 2)]),                                     # runs to the end
    ("B-PER E-PER S-LOC O".split(), [("PER", 0, 1), ("LOC", 2, 2)]),                  # IOBES
    ("O O".split(), []),
])
def test_get_entities(tags, entities):
    assert get_entities(tags) == entities


def test_bad_tag_is_reported():
    with pytest.raises(ValueError, match="not IOB"):
        get_entities(["B-PER", "PER"])


def test_entity_scores_hand_built():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O", "B-MISC", "I-MISC"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"],   # PER right, LOC typed wrong
            ["B-ORG", "O", "B-MISC", "O"]]      # ORG right, MISC boundary wrong
    s = entity_scores(gold, pred)
    # 4 gold, 4 predicted, 2 correct.
    assert (s["precision"], s["recall"], s["f1"]) == (0.5, 0.5, 0.5)
    assert s["per_type"]["PER"]["f1"] == 1.0 and s["per_type"]["LOC"]["recall"] == 0.0
    assert s["per_type"]["ORG"]["precision"] == 0.5 and s["per_type"]["MISC"]["f1"] == 0.0
    assert s["accuracy"] == pytest.approx(6 / 8)
    # A partial match earns nothing; missing everything gives 0, not a division error.
    assert entity_scores([["B-PER", "I-PER"]], [["B-PER", "O"]])["f1"] == 0.0
    assert entity_scores([["O"]], [["O"]])["f1"] == 0.0


def test_same_entities_in_either_scheme_score_the_same():
    gold = ["I-PER", "I-PER", "B-PER", "O", "I-LOC"]   # IOB1
    assert entity_scores([gold], [iob1_to_iob2(gold)])["f1"] == 1.0
    assert iob1_to_iob2(gold) == ["B-PER", "I-PER", "B-PER", "O", "B-LOC"]
    with pytest.raises(ValueError, match="gold tags but"):
        entity_scores([gold], [gold[:-1]])


@pytest.mark.parametrize("split, n_sentences, n_entities", [("train", 14041, 23499), ("dev", 3250, 5942),
                                                            ("test", 3453, 5648)])
def test_conll2003_iob1_release_converts_to_the_iob2_release(data_dir, split, n_sentences, n_entities):
    """The two distributed variants of CoNLL-2003 agree after conversion, and the entity counts are
    the published ones (Tjong Kim Sang & De Meulder 2003, Table 2)."""
    iob1 = read_conll(find_split(data_dir / "conll2003" / "original_iob1", split))
    iob2 = read_conll(find_split(data_dir / "conll2003" / "iob2_hf_style", split))
    assert len(iob1) == len(iob2) == n_sentences
    assert detect_scheme(s.tags for s in iob1) == "IOB1" and detect_scheme(s.tags for s in iob2) == "IOB2"
    assert all(a.words == b.words and iob1_to_iob2(a.tags) == b.tags for a, b in zip(iob1, iob2))
    assert sum(len(get_entities(s.tags)) for s in iob1) == n_entities
    assert entity_scores([s.tags for s in iob1], [s.tags for s in iob2])["f1"] == 1.0
