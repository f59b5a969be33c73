"""Registers, spills and shared memory of sparse GQA decode candidates compiled for sm90 on the
CPU (no launch), so a tile's programs per SM are known before any device time is spent: the
b64 x 128K entry (bucket 256) through `../tokens-m/compile_loop.py`, which also counts the main
loop's instructions.
Usage: python3 compile_candidates.py KV_FORMAT CANDIDATES_JSON
CANDIDATES_JSON: a list of changes to the sm90 b64 x 128K entry, as `qsa tune --candidates`."""
import pathlib
import runpy
import sys

sys.argv = [sys.argv[0], sys.argv[1], "256", sys.argv[2]]
runpy.run_path(str(pathlib.Path(__file__).parents[1] / "tokens-m" / "compile_loop.py"),
               run_name="__main__")
