"""A copy of the config tables with only their arch-independent defaults: the kernels then
run as they would on a GPU nobody has tuned for (`get_config` falls back to "default").
Run `qsa step` with QSA_CONFIG_DIR pointing at the copy, and again without it, for the step
before and after tuning in one run.
Usage: python3 untuned_tables.py OUT_DIR"""
import json
import pathlib
import sys

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for table in pathlib.Path(__file__).resolve().parents[3].joinpath("qsa/configs/tables").glob("*.json"):
    defaults = {"default": json.loads(table.read_text())["default"]}
    (out / table.name).write_text(json.dumps(defaults, indent=1, sort_keys=True) + "\n")
