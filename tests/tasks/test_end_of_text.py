"""`evict generate` stops at the tokenizer's end-of-text id and does not print it."""

import contextlib
import io
from types import SimpleNamespace

import torch

from evict.commands.generate import run_generate
from evict.models import LM
from evict.models.config import ModelConfig
from evict.tasks.tokenizers import CharTokenizer


def _greedy(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, temperature=0.0)[0, prompt.shape[1]:].tolist()


def test_generate_cli_stops_at_end_of_text(tmp_path):
    chars = "abcdefghijklmnop"
    tok = CharTokenizer(chars, eos=True)  # vocab 17, eos = 16
    prompt = torch.as_tensor(tok.encode("abc"))[None]
    for seed in range(20):  # a random model whose greedy continuation has a fresh token after the first
        torch.manual_seed(seed)
        model = LM(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, head_dim=16, d_ff=64,
                               pattern="A", tie_embeddings=False, init_std=0.5))
        new = _greedy(model, prompt, 12)
        fresh = [i for i in range(1, len(new)) if new[i] not in new[:i] + [0, 1, 2, tok.eos_token_id]]
        if fresh:
            break
    # that token (at position k >= 1, never seen before, not in the prompt) becomes eos: swap its embedding and head
    # rows with eos's, so the permuted model emits eos exactly where it emitted that token
    k = fresh[0]
    t, e = new[k], tok.eos_token_id
    with torch.no_grad():
        for w in (model.embed.weight, model.head.weight):
            w[[t, e]] = w[[e, t]]
    assert _greedy(model, prompt, 12)[: k + 1] == new[:k] + [e]
    folder = tmp_path / "model"
    model.save(folder)
    tok.save(folder / "tokenizer.json")
    args = SimpleNamespace(model=str(folder), prompt="abc", max_new_tokens=12, temperature=0.0, top_k=None, top_p=None,
                           seed=0, stop=None, device="cpu", threads=1)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        stats = run_generate(args)
    assert stats["text"] == tok.decode(new[:k])  # stopped at end-of-text, which is not part of the text
    assert out.getvalue().startswith("abc" + stats["text"]) and "<|endoftext|>" not in out.getvalue()
