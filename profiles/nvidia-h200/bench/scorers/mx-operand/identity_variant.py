"""Rewrites qsa/kernels/index_tiles.py in place (on a scratch copy of the tree) so that the
decoded MXFP4 block passes through a max over a size-1 axis before the dot: the variant that
stops Triton from tracing the operand's k-width back to the 8-bit code load (see
../../attention/sweep-slots/NOTES.md). Not the committed code."""
from pathlib import Path

p = Path("qsa/kernels/index_tiles.py")
s = p.read_text()
old = """    lo, hi = load_mx_halves(kc_ptr, key_off, ok, c)
    return tl.reshape(tl.join(lo, hi), (lo.shape[0], 32))"""
new = """    lo, hi = load_mx_halves(kc_ptr, key_off, ok, c)
    x = tl.reshape(tl.join(lo, hi), (lo.shape[0], 32, 1))
    return tl.max(x, axis=2).to(tl.float16)"""
assert old in s
p.write_text(s.replace(old, new))
