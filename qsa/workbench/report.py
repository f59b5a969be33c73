"""Markdown tables of a stored run, and the README blocks that hold them.

Why: a results table typed by hand drifts from the run it quotes. The README marks each table
with the run it comes from (`<!-- results: RUN_DIR -->` ... `<!-- /results -->`);
`qsa report --readme README.md` rewrites every such block from its run, and `--check` fails
when one differs, so a test keeps the README and the committed runs in agreement.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from qsa.measure.results import load_run
from qsa.workbench.registry import find

BLOCK = re.compile(r"(<!-- results: (?P<run>\S+) -->\n)(?P<body>.*?)(<!-- /results -->)",
                   re.S)
SHAPE_KEYS = ("op", "batch", "context", "rows", "selection", "overlap_target")


def _tokens(n: float) -> str:
    n = int(n)
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _column(r: pd.Series, forced: bool) -> str:
    """A point's column: the storage format it reads and, in a run that forces sparse GQA
    paths, the path it was asked to take (or "chosen" per call)."""
    spec = find(r["op"])
    fmt = spec.storage_format(r["index_format"], r["kv_format"])
    if spec.storage == "scores":
        fmt += " scores"
    sharing = r.get("sharing")
    if not forced or not isinstance(sharing, str):
        return str(fmt)
    return f"{fmt} {'chosen' if sharing == 'auto' else sharing}"


def _shape(r: pd.Series) -> str:
    s = f"{r['op']}, b{int(r['batch'])} x {_tokens(r['context'])}, {int(r['rows'])} rows"
    ov = r.get("overlap_target")
    if isinstance(ov, float) and not pd.isna(ov) and find(r["op"]).takes_selection:
        s += f", overlap {ov:g}"
    return s


def points_table(df: pd.DataFrame) -> str:
    """One line per shape, one column per format (and forced path); each cell µs per call,
    then its speed against the line's first column, measured in the same run, and, in a run
    where some call ran another implementation than Triton, the implementation each call ran
    (`impl`). A step run (`qsa step`) has no points."""
    if "verified" not in df or "us" not in df:
        return ""
    pts = df[(df.get("record", "point") == "point") & df["verified"].eq(True)
             & df["us"].notna()].copy()
    if pts.empty:
        return ""
    forced = "sharing" in pts and bool(pts["sharing"].isin(["per-row", "shared"]).any())
    impls = pts["impl"].dropna() if "impl" in pts else pd.Series(dtype=object)
    show_impl = bool(impls.ne("triton").any())
    pts["column"] = pts.apply(_column, axis=1, forced=forced)
    pts["shape"] = pts.apply(_shape, axis=1)
    cols = list(dict.fromkeys(pts["column"]))
    lines = ["| kernel, shape | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for shape, g in pts.groupby("shape", sort=False):
        us = g.groupby("column")["us"].median()
        first = next((us[c] for c in cols if c in us), None)
        cells = []
        for c in cols:
            if c not in us:
                cells.append("")
                continue
            ratio = "" if us[c] == first else f" ({first / us[c]:.2f}x)"
            extra = ""
            row = g[g["column"] == c].iloc[0]
            if isinstance(row.get("path"), str) and row.get("sharing") == "auto":
                extra = f", {row['path']}"
            if show_impl and isinstance(row.get("impl"), str):
                extra += f", {row['impl']}"
            cells.append(f"{us[c]:.1f} µs{ratio}{extra}")
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def steps_table(df: pd.DataFrame) -> str:
    """Steps of the run: per phase, shape and overlap, each format pair's summed and
    graph-replayed µs, and its speed against the first pair. A suite marks its step rows
    (`record`); every row of a `qsa step` run is one."""
    if "step_phase" not in df:
        return ""
    steps = df["record"] == "step" if "record" in df else True
    st = df[steps & df["kernel"].isin(["sum of kernels", "graph replay"])]
    if st.empty:
        return ""
    st = st.assign(pair=st["index_format"] + "/" + st["kv_format"],
                   overlap=st["overlap_target"] if "overlap_target" in st else 0.0)
    lines = ["| step | index/KV | summed | graph replay |", "|---|---|---|---|"]
    keys = ["step_phase", "batch", "context", "overlap"]
    for key, g in st.groupby(keys, sort=False, dropna=False):
        phase, batch, ctx, ov = key
        what = (f"{phase}, b{int(batch)} x {_tokens(ctx)}, overlap "
                f"{0.0 if pd.isna(ov) else ov:g}")
        base: dict[str, float] = {}
        for pair, p in g.groupby("pair", sort=False):
            cells = []
            for kind in ("sum of kernels", "graph replay"):
                v = p.loc[p["kernel"] == kind, "us_per_step"]
                if v.empty:
                    cells.append("")
                    continue
                us = float(v.iloc[0])
                base.setdefault(kind, us)
                ratio = "" if base[kind] == us else f" ({base[kind] / us:.2f}x)"
                cells.append(f"{us:,.0f} µs{ratio}")
            lines.append(f"| {what} | {pair} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_tables(run_dir: str | Path) -> str:
    """The Markdown a README block holds for one run: its id and device, its points, its
    steps and, for a suite, its targets."""
    from qsa.workbench.suites import targets_markdown

    df, meta = load_run(run_dir)
    dev = meta.get("device", {})
    name = dev.get("name", "?") if isinstance(dev, dict) else str(dev)
    versions = meta.get("versions", {})
    head = (f"Run `{meta.get('run_id', Path(run_dir).name)}` on {name} (torch "
            f"{versions.get('torch', '?')}, Triton {versions.get('triton', '?')}); every point "
            "verified, then timed by graph replay over inputs rotated past the L2; ratios are "
            "against the line's first column, in the same run.\n\n")
    parts = [head, points_table(df)]
    steps = steps_table(df)
    if steps:  # below the points, if the run has any (a `qsa step` run has none)
        parts += ["\n", steps] if parts[-1] else [steps]
    targets = Path(run_dir) / "targets.json"
    if targets.exists():
        import json

        parts += ["\n", targets_markdown(json.loads(targets.read_text()),
                                         meta.get("run_id", ""))]
    return "".join(parts)


def update_readme(readme: str | Path, root: str | Path | None = None) -> tuple[str, list[str]]:
    """The README with every results block regenerated from its run (paths relative to
    `root`, default the README's folder), and the runs whose blocks changed."""
    path = Path(readme)
    base = Path(root) if root is not None else path.parent
    text = path.read_text()
    changed: list[str] = []

    def fill(m: re.Match) -> str:
        body = run_tables(base / m["run"])
        if body != m["body"]:
            changed.append(m["run"])
        return f"{m.group(1)}{body}{m.group(4)}"

    return BLOCK.sub(fill, text), changed
