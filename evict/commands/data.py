"""`evict data prepare DATA --out X.bin`: tokenise a corpus once, in parallel, into a .bin (evict.data.prepare)."""

from __future__ import annotations

from evict.cli_args import positive_int


def add_parser(sub) -> None:
    """Register `evict data prepare` on the argparse subparsers object."""
    d = sub.add_parser("data", help="prepare training data: tokenise a corpus once into a .bin")
    what = d.add_subparsers(dest="data_command", required=True)
    p = what.add_parser("prepare", help="tokenise DATA (txt, jsonl, parquet, datasets folder) into OUT.bin + meta")
    p.add_argument("data", nargs="?", default=None, help="the corpus (default: Shakespeare)")
    p.add_argument("--out", required=True, help="the .bin to write (its .json meta and .tokenizer.json go beside it)")
    p.add_argument("--tokenizer", default="bpe", help="char, byte, bpe (trained here) or a tokenizer.json (default bpe)")
    p.add_argument("--bpe-vocab", type=positive_int, default=2048, help="bpe: vocabulary size (default 2048)")
    p.add_argument("--text-field", default="text", help="jsonl / parquet / datasets: the text field (default text)")
    p.add_argument("--workers", type=positive_int, default=None, help="tokenising processes (default min(8, cores))")
    p.set_defaults(fn=run_prepare)


def run_prepare(args) -> dict:
    from evict.data.prepare import prepare

    meta = prepare(args.data, args.out, tokenizer=args.tokenizer, bpe_vocab_size=args.bpe_vocab,
                   text_field=args.text_field, workers=args.workers)  # a ValueError is the CLI's one-line error
    print(f"{args.out}: {meta['tokens']:,} tokens from {meta['documents']:,} documents ({meta['dtype']}, "
          f"vocab {meta['vocab_size']})")
    return meta
