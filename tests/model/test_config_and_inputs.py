"""BertConfig presets, HF config.json I/O, validation, and bad model inputs."""
import json

import pytest
import torch

import fastbert
from fastbert.config import ConfigError, PRESETS
from fastbert.model import InputError
from fastbert.padding import pad, unpad, unpad_mask


@pytest.mark.parametrize("name,layers,hidden", [("tiny", 2, 128), ("mini", 4, 256), ("small", 4, 512),
                                                 ("medium", 8, 512), ("base", 12, 768), ("large", 24, 1024)])
def test_presets(name, layers, hidden):
    cfg = fastbert.BertConfig.preset(name)
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (layers, hidden)
    assert cfg.num_attention_heads == hidden // 64 and cfg.intermediate_size == 4 * hidden
    assert set(PRESETS) == {"tiny", "mini", "small", "medium", "base", "large"}


def test_base_parameter_count():
    model = fastbert.BertModel(fastbert.BertConfig.preset("base"))
    assert model.num_parameters() == 109_482_240  # bert-base-uncased's BertModel


def test_hf_config_round_trip(tmp_path):
    cfg = fastbert.BertConfig.preset("small", prenorm=True, hidden_act="gelu_tanh", num_labels=4)
    cfg.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["hidden_act"] == "gelu_pytorch_tanh" and raw["model_type"] == "bert" and raw["fastbert_prenorm"]
    back = fastbert.BertConfig.from_pretrained(tmp_path)
    for field in ("hidden_size", "num_hidden_layers", "prenorm", "hidden_act", "num_labels"):
        assert getattr(back, field) == getattr(cfg, field)
    import transformers
    hf = transformers.BertConfig.from_pretrained(str(tmp_path))
    assert hf.hidden_size == 512 and hf.num_labels == 4


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_size=100, num_attention_heads=12), "divisible by num_attention_heads"),
    (dict(vocab_size=0), "vocab_size must be a positive integer"),
    (dict(num_hidden_layers=-1), "num_hidden_layers must be a positive integer"),
    (dict(hidden_act="relu"), "hidden_act='relu' is not supported"),
    (dict(kernels="cuda"), "kernels='cuda' is not known"),
    (dict(hidden_dropout_prob=1.5), r"hidden_dropout_prob must be in \[0, 1\)"),
])
def test_invalid_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        fastbert.BertConfig(**kwargs)


def test_kernels_auto_is_the_one_rule():
    """BertConfig takes "auto" like the training config and resolves it by fastbert.ops.resolve_kernels."""
    from fastbert.ops import resolve_kernels
    expected = resolve_kernels("auto")
    assert fastbert.BertConfig(kernels="auto").kernels == expected
    assert fastbert.BertConfig.preset("tiny", kernels="auto").kernels == expected
    assert fastbert.BertConfig(kernels="torch").replace(kernels="auto").kernels == expected
    with pytest.raises(ConfigError, match="use 'auto' or one of"):
        fastbert.BertConfig(kernels="cuda")


def test_unsupported_hf_configs():
    with pytest.raises(ConfigError, match="position_embedding_type"):
        fastbert.BertConfig.from_dict({"position_embedding_type": "relative_key"})
    with pytest.raises(ConfigError, match="unknown preset"):
        fastbert.BertConfig.preset("huge")


def test_bad_inputs():
    model = fastbert.BertModel(fastbert.BertConfig.preset("tiny", vocab_size=50, max_position_embeddings=16))
    with pytest.raises(InputError, match="outside the vocabulary"):
        model(input_ids=torch.tensor([[1, 2, 50]]))
    with pytest.raises(InputError, match="exceeds max_position_embeddings=16"):
        model(input_ids=torch.ones(1, 17, dtype=torch.long))
    with pytest.raises(InputError, match="attention_mask has shape"):
        model(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(InputError, match="unsupported argument"):
        model(input_ids=torch.ones(2, 5, dtype=torch.long), head_mask=torch.ones(2))


def test_unpad_pad_round_trip():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 0, 8])
    mask = (torch.arange(8)[None] < lengths[:, None]).long()
    x = torch.randn(4, 8, 3, generator=g) * mask[..., None]
    info = unpad_mask(mask)
    assert info.cu_seqlens.dtype == torch.int32
    assert info.cu_seqlens.tolist() == [0, 5, 6, 6, 14] and info.max_seqlen == 8
    flat = unpad(x, info)
    assert flat.shape == (14, 3)
    torch.testing.assert_close(pad(flat, info), x, atol=0, rtol=0)
