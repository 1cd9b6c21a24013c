"""Converters read every weight or refuse: no random layer, no default config, no silent dtype change."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from evict.cli import main  # noqa: E402
from evict.models import LM  # noqa: E402
from evict.models.config import ModelConfig  # noqa: E402


def _hf_folder(path, n_layer=2, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=61, n_positions=32, n_embd=32, n_layer=n_layer, n_head=4,
                                  bos_token_id=None, eos_token_id=None)
    transformers.GPT2LMHeadModel(cfg).to(dtype).save_pretrained(path)
    return path


def _convert(tmp_path, src, capsys):
    capsys.readouterr()  # what writing the source printed
    with pytest.raises(SystemExit) as e:
        main(["convert", "gpt2", str(src), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and not (tmp_path / "out").exists()
    return err[0]


def test_an_evict_folder_is_not_a_gpt2(tmp_path, capsys):
    LM(ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, pattern="K")).save(tmp_path / "kda")
    assert "is not a transformers GPT-2 config" in _convert(tmp_path, tmp_path / "kda", capsys)


def test_a_config_with_more_layers_than_the_weights_is_refused(tmp_path, capsys):
    src = _hf_folder(tmp_path / "hf", n_layer=2)
    cfg = json.loads((src / "config.json").read_text())
    cfg["n_layer"] = 3
    (src / "config.json").write_text(json.dumps(cfg))
    line = _convert(tmp_path, src, capsys)
    assert "lacks weights" in line and "h.2." in line


def test_weights_the_config_has_no_place_for_are_refused(tmp_path, capsys):
    src = _hf_folder(tmp_path / "hf", n_layer=3)
    cfg = json.loads((src / "config.json").read_text())
    cfg["n_layer"] = 2
    (src / "config.json").write_text(json.dumps(cfg))
    assert "h.2." in _convert(tmp_path, src, capsys)


def test_a_weight_of_another_shape_is_refused(tmp_path, capsys):
    src = _hf_folder(tmp_path / "hf")
    tensors = load_file(src / "model.safetensors")
    tensors["transformer.h.1.mlp.c_fc.bias"] = torch.zeros(5)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert "h.1.mlp.c_fc" in _convert(tmp_path, src, capsys)


def test_a_truncated_weight_file_is_named(tmp_path, capsys):
    src = _hf_folder(tmp_path / "hf")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    line = _convert(tmp_path, src, capsys)
    assert "model.safetensors is not a readable safetensors file" in line


def test_bfloat16_stays_bfloat16(tmp_path, capsys):
    src = _hf_folder(tmp_path / "hf", dtype=torch.bfloat16)
    assert main(["convert", "gpt2", str(src), "--out", str(tmp_path / "ev")]) == 0
    assert "bfloat16" in capsys.readouterr().out
    saved = load_file(tmp_path / "ev" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    hf = transformers.GPT2LMHeadModel.from_pretrained(src, dtype="auto")
    assert torch.equal(saved["embed.weight"], hf.transformer.wte.weight.detach())


def test_from_hf_gpt2_refuses_a_state_with_a_layer_it_would_not_read():
    from evict.convert.gpt2 import gpt2_state_dict

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=61, n_positions=32, n_embd=32, n_layer=2,
                                                              n_head=4))
    state = hf.state_dict()
    with pytest.raises(ValueError, match=r"^hf_model: holds weights evict would not read.*h\.1\."):
        gpt2_state_dict(state, 1)
    with pytest.raises(ValueError, match=r"^hf_model: lacks the weight transformer\.h\.2\.ln_1\.weight"):
        gpt2_state_dict(state, 3)
