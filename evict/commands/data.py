"""`evict data prepare DATA --out X.bin`: tokenise a corpus once, in parallel, into a .bin (evict.tasks.prepare)."""

from __future__ import annotations

from evict.cli_args import described, positive_int


def add_parser(sub) -> None:
    """Register `evict data prepare` on the argparse subparsers object."""
    d = sub.add_parser("data", **described(
        "prepare training data: tokenise a corpus once into a .bin",
        "Training data tools. `prepare` tokenises a corpus once, in parallel, into a nanoGPT-style token file\n"
        "(uint16 or uint32 .bin) with a JSON meta and the tokenizer beside it; `evict train --data X.bin` streams it.",
        "evict data prepare notes.jsonl --text-field text --out runs/data/notes.bin"))
    what = d.add_subparsers(dest="data_command", required=True)
    p = what.add_parser("prepare", **described(
        "tokenise DATA (txt, jsonl, parquet, datasets folder) into OUT.bin + meta",
        "Tokenise DATA (a .txt file or folder, .jsonl with a text field, .parquet, or a `datasets` folder saved\n"
        "offline; default the shipped Shakespeare) with a tokenizer trained here or given as a tokenizer.json, in\n"
        "parallel with a progress bar. Writes OUT (.bin), its .json meta and .tokenizer.json, each only once complete.",
        "evict data prepare --out runs/data/shakespeare.bin --tokenizer char",
        "evict data prepare notes.jsonl --text-field body --out runs/data/notes.bin --bpe-vocab 4096"))
    p.add_argument("data", nargs="?", default=None, help="the corpus (default: Shakespeare)")
    p.add_argument("--out", required=True, help="the .bin to write (its .json meta and .tokenizer.json go beside it)")
    p.add_argument("--tokenizer", default="bpe", help="char, byte, bpe (trained here) or a tokenizer.json (default bpe)")
    p.add_argument("--bpe-vocab", type=positive_int, default=2048, help="bpe: vocabulary size (default 2048)")
    p.add_argument("--text-field", default="text", help="jsonl / parquet / datasets: the text field (default text)")
    p.add_argument("--workers", type=positive_int, default=None, help="tokenising processes (default min(8, cores))")
    p.set_defaults(fn=run_prepare)


def run_prepare(args) -> dict:
    from evict.tasks.prepare import prepare

    meta = prepare(args.data, args.out, tokenizer=args.tokenizer, bpe_vocab_size=args.bpe_vocab,
                   text_field=args.text_field, workers=args.workers)  # a ValueError is the CLI's one-line error
    print(f"{args.out}: {meta['tokens']:,} tokens from {meta['documents']:,} documents ({meta['dtype']}, "
          f"vocab {meta['vocab_size']})")
    return meta
