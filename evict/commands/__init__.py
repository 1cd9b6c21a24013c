"""`evict …` subcommands: one module per command, each with add_parser(sub) that registers its flags and its run
function (`evict lab …` is a package, one module per experiment). The work itself lives in the library below;
evict/cli.py puts the commands together and turns user errors into one line."""
