"""One verified call of the stacked scorer (b64 x 128K, MXFP4) for ncu: committed or new."""
import sys
import old_score_stacked
import qsa.kernels.score_stacked as new
from qsa.presets import DEFAULT_PRESET, as_preset
from qsa.workbench.ops import Point, prepare
if sys.argv[1] == "committed":
    new.score_stacked = old_score_stacked.score_stacked
prep = prepare(Point("score_stacked", as_preset(DEFAULT_PRESET), 64, 131072, 4, sys.argv[2]))
prep.check(None)
prep.call(1, None)
