"""Export to fla's HF models: the folder's config, names, shapes and values on CPU; fla's own logits on a GPU."""

import json

import pytest
import torch
from safetensors.torch import load_file

from evict.cli import main
from evict.convert import fla_config, to_fla
from evict.models import LM, presets

D, H, HD, V, FF, L = 64, 2, 32, 53, 96, 3


def _lm(name: str, **kw) -> LM:
    torch.manual_seed(0)
    return LM(presets.get(name, vocab_size=V, n_layers=L, d_model=D, n_heads=H, head_dim=HD, d_ff=FF, **kw))


def _expected_shapes(kind: str, tied: bool) -> dict:
    """fla's parameter names and shapes for these sizes (from fla's model classes' documented layout)."""
    k = H * HD
    out = {"model.embeddings.weight": (V, D), "model.norm.weight": (D,)}
    if not tied:
        out["lm_head.weight"] = (V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        out.update({p + "attn_norm.weight": (D,), p + "mlp_norm.weight": (D,), p + "mlp.gate_proj.weight": (FF, D),
                    p + "mlp.up_proj.weight": (FF, D), p + "mlp.down_proj.weight": (D, FF)})
        a = p + "attn."
        for n in "qkv":
            out[f"{a}{n}_proj.weight"] = (k, D)
            out[f"{a}{n}_conv1d.weight"] = (k, 1, 4)
        out.update({a + "b_proj.weight": (H, D), a + "A_log": (H,), a + "o_norm.weight": (HD,), a + "o_proj.weight": (D, k)})
        if kind == "kda":
            out.update({a + "f_proj.0.weight": (HD, D), a + "f_proj.1.weight": (k, HD), a + "dt_bias": (k,),
                        a + "g_proj.0.weight": (HD, D), a + "g_proj.1.weight": (k, HD), a + "g_proj.1.bias": (k,)})
        else:
            out.update({a + "a_proj.weight": (H, D), a + "dt_bias": (H,), a + "g_proj.weight": (k, D)})
    return out


@pytest.mark.parametrize("name,kw,model_type", [("kda", {}, "kda"), ("kda", {"gate_form": "bounded", "tie_embeddings": False}, "kda"),
                                                ("gated_deltanet", {"out_gate_rank": None}, "gated_deltanet")])
def test_export_folder_structure(tmp_path, name, kw, model_type):
    lm = _lm(name, **kw)
    out = to_fla(lm, tmp_path / "fla")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == model_type and cfg["hidden_size"] == D and cfg["num_hidden_layers"] == L
    assert (cfg["num_heads"], cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (H, HD, FF, V)
    assert cfg["tie_word_embeddings"] == lm.cfg.tie_embeddings
    if kw.get("gate_form") == "bounded":
        assert cfg["safe_gate"] is True and cfg["lower_bound"] == -5.0
    tensors = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == _expected_shapes(name, lm.cfg.tie_embeddings)
    sd = lm.state_dict()
    q, k, v = sd["blocks.1.mixer.wqkv.weight"].split(H * HD)
    assert torch.equal(tensors["model.layers.1.attn.k_proj.weight"], k)
    assert torch.equal(tensors["model.layers.1.attn.v_conv1d.weight"], sd["blocks.1.mixer.conv.weight"][2 * H * HD:])
    assert torch.equal(tensors["model.layers.2.mlp.up_proj.weight"], sd["blocks.2.ffn.w3.weight"])


@pytest.mark.parametrize("name,kw,field", [
    ("kimi_linear", {}, "pattern"), ("deltanet", {}, "pattern"), ("gpt2", {}, "pattern"),
    ("kda", {"moe": {"n_routed": 4}}, "moe"), ("kda", {"ffn": "situ"}, "ffn"), ("kda", {"attn_res": True}, "attn_res"),
    ("kda", {"out_gate_rank": None}, "out_gate_rank"), ("gated_deltanet", {}, "out_gate_rank"),
    ("gated_deltanet", {"out_gate_rank": None, "gate_form": "bounded"}, "gate_form"),
    ("kda", {"pattern": "KA", "pos": "learned"}, "pos"), ("kda", {"pattern": "KA", "bias": True}, "bias"),
])
def test_what_does_not_map_is_refused_by_name(tmp_path, name, kw, field):
    lm = _lm(name, **kw)
    with pytest.raises(ValueError, match=f"^{field}: "):
        to_fla(lm, tmp_path / "fla")
    assert not (tmp_path / "fla").exists()


def test_attention_layers_map_to_fla_attn_list():
    cfg = presets.get("kda", pattern="KKA", n_layers=6, d_model=64, n_heads=2, head_dim=32, n_kv_heads=1)
    assert fla_config(cfg)["attn"] == {"layers": [2, 5], "num_heads": 2, "num_kv_heads": 1, "qkv_bias": False,
                                       "window_size": None, "rope_theta": 10000.0}


def test_cli_convert_fla(tmp_path, capsys):
    _lm("kda").save(tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").write_text('{"kind": "byte"}')
    assert main(["convert", "fla", str(tmp_path), "--out", str(tmp_path / "fla"), "--dtype", "bfloat16"]) == 0
    tensors = load_file(str(tmp_path / "fla" / "model.safetensors"))
    assert tensors["model.layers.0.attn.q_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.attn.A_log"].dtype == torch.float32  # fla keeps the decay parameters in float32
    assert (tmp_path / "fla" / "tokenizer.json").is_file()
    with pytest.raises(SystemExit) as e:  # the folder exists now: refused, nothing touched
        main(["convert", "fla", str(tmp_path), "--out", str(tmp_path / "fla")])
    assert e.value.code == 2 and "already exists" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw", [("kda", {}), ("kda", {"gate_form": "bounded", "neg_eigval": True, "tie_embeddings": False}),
                                     ("gated_deltanet", {"out_gate_rank": None})])
@pytest.mark.parametrize("T", [40, 200])  # fla runs its fused recurrent kernel up to 64 tokens, the chunked one past
def test_fla_loads_the_export_and_its_logits_match(tmp_path, name, kw, T):
    pytest.importorskip("fla")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    lm = LM(presets.get(name, vocab_size=97, n_layers=2, d_model=256, n_heads=2, head_dim=128, d_ff=512, init_std=0.05,
                        **kw)).eval()
    to_fla(lm, tmp_path / "fla")
    fla_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fla", dtype=torch.float32).cuda().eval()
    lm = lm.cuda()
    x = torch.randint(0, 97, (2, T), device="cuda")
    with torch.no_grad():
        want, got = lm(x).double(), fla_model(x).logits.double()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 5e-3, err  # a wrong or transposed tensor gives O(1); fla's float32 kernels may round through TF32
