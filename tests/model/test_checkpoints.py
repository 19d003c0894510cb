"""Real checkpoint parity (all-MiniLM-L6-v2), save/load round trips through HF, checkpoint errors."""
import json
import lzma
import zipfile

import pytest
import torch
import transformers

import fastbert
from fastbert.hf import CheckpointError
from fastbert.model import mean_pool

ATOL = 1e-5


def real_sentences(data_dir):
    lines = []
    with lzma.open(data_dir / "pretrain/enwiki_wikiextractor/wiki_00.xz", "rt", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("<"):
                lines.append(line[:300])
            if len(lines) == 6:
                break
    with zipfile.ZipFile(data_dir / "multilingual/udhr2.zip") as z:
        names = [n for n in z.namelist() if n.endswith(".txt")]
        for lang in ("deu", "fra", "rus", "jpn", "arb", "hin"):
            match = [n for n in names if lang in n.rsplit("/", 1)[-1]]
            if match:
                text = z.read(match[0]).decode("utf-8", "replace").split("\n")
                body = [t.strip() for t in text if len(t.strip()) > 40]
                if body:
                    lines.append(body[min(3, len(body) - 1)][:300])
    assert len(lines) >= 8
    return lines


def test_minilm_matches_hf(minilm_dir, data_dir):
    sentences = real_sentences(data_dir)
    tok = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    enc = tok(sentences, padding=True, truncation=True, max_length=128, return_tensors="pt")
    hf = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    fb = fastbert.BertModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        o_h = hf(**enc)
        o_f = fb(**enc)
    m = enc["attention_mask"].bool()
    torch.testing.assert_close(o_f.last_hidden_state[m], o_h.last_hidden_state[m], atol=ATOL, rtol=0)
    torch.testing.assert_close(o_f.pooler_output, o_h.pooler_output, atol=ATOL, rtol=0)
    e_h = mean_pool(o_h.last_hidden_state, enc["attention_mask"])
    e_f = mean_pool(o_f.last_hidden_state, enc["attention_mask"])
    torch.testing.assert_close(e_f, e_h, atol=ATOL, rtol=0)


def test_save_load_round_trip_through_hf(tmp_path):
    torch.manual_seed(0)
    cfg = fastbert.BertConfig.preset("tiny", vocab_size=120, num_labels=3, hidden_act="gelu_tanh")
    fb = fastbert.BertForSequenceClassification(cfg).eval()
    fb.save_pretrained(tmp_path / "a")
    saved = json.loads((tmp_path / "a/config.json").read_text())
    assert saved["architectures"] == ["BertForSequenceClassification"]
    hf = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "a")).eval()
    ids = torch.randint(1, 120, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(fb(input_ids=ids).logits, hf(input_ids=ids).logits, atol=ATOL, rtol=0)
    hf.save_pretrained(str(tmp_path / "b"))
    back = fastbert.BertForSequenceClassification.from_pretrained(tmp_path / "b").eval()
    for (k, a), (k2, b) in zip(fb.state_dict().items(), back.state_dict().items(), strict=True):
        assert k == k2
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert back.config.hidden_act == "gelu_tanh" and back.config.num_labels == 3


def test_pretraining_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    fb = fastbert.BertForPreTraining(fastbert.BertConfig.preset("tiny", vocab_size=120)).eval()
    fb.save_pretrained(tmp_path)
    hf = transformers.BertForPreTraining.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(1, 120, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(fb(input_ids=ids).prediction_logits, hf(input_ids=ids).prediction_logits,
                                   atol=ATOL, rtol=0)
    # a head model built from a bare encoder checkpoint initializes only the head
    enc = fastbert.BertForQuestionAnswering.from_pretrained(tmp_path)
    torch.testing.assert_close(enc.bert.embeddings.word_embeddings.weight, fb.bert.embeddings.word_embeddings.weight)


def test_tied_decoder_is_stored_once_and_both_forms_load(tmp_path):
    """The MLM decoder is tied (weight = word embeddings, bias = cls.predictions.bias): stored once,
    as HF saves it, and checkpoints that do store it (older HF and fastbert files) load the same."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    fb = fastbert.BertForPreTraining(fastbert.BertConfig.preset("tiny", vocab_size=4000)).eval()
    fb.save_pretrained(tmp_path / "once")
    stored = load_file(str(tmp_path / "once/model.safetensors"))
    assert not any(k.startswith("cls.predictions.decoder.") for k in stored)
    unique = sum(p.numel() for p in fb.parameters()) * 4  # fp32 bytes, each shared tensor once
    assert (tmp_path / "once/model.safetensors").stat().st_size < unique * 1.01
    hf = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "once")).eval()
    assert hf.cls.predictions.decoder.weight.data_ptr() == hf.bert.embeddings.word_embeddings.weight.data_ptr()
    # the other form: the tied tensors stored a second time
    dup = dict(stored, **{"cls.predictions.decoder.weight": stored["bert.embeddings.word_embeddings.weight"].clone(),
                          "cls.predictions.decoder.bias": stored["cls.predictions.bias"].clone()})
    (tmp_path / "dup").mkdir()
    save_file(dup, str(tmp_path / "dup/model.safetensors"))
    (tmp_path / "dup/config.json").write_text((tmp_path / "once/config.json").read_text())
    ids = torch.randint(1, 4000, (2, 9))
    with torch.no_grad():
        want = hf(input_ids=ids).prediction_logits
        for d in ("once", "dup"):
            got = fastbert.BertForPreTraining.from_pretrained(tmp_path / d).eval()(input_ids=ids).prediction_logits
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # a decoder that is NOT the word embeddings cannot be tied: refused, not silently replaced
    dup["cls.predictions.decoder.weight"] = dup["cls.predictions.decoder.weight"] + 1
    save_file(dup, str(tmp_path / "dup/model.safetensors"))
    with pytest.raises(CheckpointError, match="untied MLM decoder"):
        fastbert.BertForPreTraining.from_pretrained(tmp_path / "dup")


def test_bin_checkpoint(tmp_path):
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                                        num_attention_heads=2, intermediate_size=40))
    hf.config.to_json_file(str(tmp_path / "config.json"))
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    fb = fastbert.BertModel.from_pretrained(tmp_path)
    assert fb.config.hidden_size == 32


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        fastbert.BertModel.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        fastbert.BertModel.from_pretrained(tmp_path / "empty")
    fastbert.BertConfig.preset("tiny").save_pretrained(tmp_path / "noweights")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        fastbert.BertModel.from_pretrained(tmp_path / "noweights")
    # wrong shapes and missing encoder tensors are listed together
    fastbert.BertModel(fastbert.BertConfig.preset("tiny", vocab_size=99)).save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    cfg["vocab_size"] = 120
    (tmp_path / "m/config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"shape mismatch \(1\): embeddings.word_embeddings.weight"):
        fastbert.BertModel.from_pretrained(tmp_path / "m")
    cfg["vocab_size"], cfg["num_hidden_layers"] = 99, 3
    (tmp_path / "m/config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(\d+\): encoder.layer.2"):
        fastbert.BertModel.from_pretrained(tmp_path / "m")
